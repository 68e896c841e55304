"""Shared-memory slots for the tokens a dataloader worker sends: written once by the worker,
read once by the training process, never pickled or piped.

A message of ``G`` batches of ``8 x 4,097`` int64 tokens is 1 MB. Sent in the message, it is
copied five times on its way (into the group tensor, into the pickle, into the pipe, out of
the pipe, out of the pickle), each copy into freshly allocated memory: on the 2-core machine
of the benchmarks that was ~0.02 CPU s per million tokens, as much as the whole pipeline's
work per token, spent by the worker's queue thread and the training process. A
:class:`TokenRing` is allocated once per worker in shared memory (``torch``'s
``share_memory_``) and crosses the process boundary once, in the worker's first message that
uses it; after that a message names a slot.

The worker writes a group's tokens into the next slot if the training process has released
it, else sends them in the message as before (:meth:`TokenRing.claim` returns None). So a
worker never waits for a slot, and a slow consumer only costs the copies the ring saves. The
training process copies each batch's ``input_ids`` / ``labels`` out of the slot (the copies
it always made, see :meth:`~torchdata_ext.batch.PackedBatch.to_tensors`), then releases it
(:meth:`TokenRing.release`). Slots are used and released in order: a worker's messages reach
the training process in the order it sent them.

Shared memory is ``/dev/shm`` on Linux, which containers often keep small (Docker: 64 MB). A
worker makes its ring only when that leaves room to spare (:meth:`TokenRing.make`), else its
tokens go in the messages; running out of shared memory would kill the worker.

Ordering: the reader's copy out of a slot happens before its store to :attr:`TokenRing.
released`, and the writer reads that count before writing the slot. On x86 (total store
order) a store is never moved before the loads that precede it, so this is safe; between the
two the reader runs thousands of interpreter instructions and a torch call on every
architecture.
"""

from __future__ import annotations

import logging
import math
import os

import torch

__all__ = ["TokenRing"]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_SPARE = 8  # make a ring only if shared memory has this many times its size free ...
_FLOOR = 32 << 20  # ... plus this much for everything else that uses it (NCCL, other workers)


def _free_bytes(path: str) -> int | None:
    """Free bytes of the file system at ``path`` (None: not there, e.g. not Linux)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class TokenRing:
    """``slots`` token tensors of one ``shape`` and ``dtype`` in shared memory, and a count
    of the slots the reader has released.

    Args:
        shape: one slot's token tensor shape (``[G, B, size]``).
        dtype: the tokens' dtype.
        slots: how many groups can be in flight at once (the dataloader's prefetch, plus the
            one being read and the one being written).
    """

    @classmethod
    def make(cls, shape: tuple[int, ...], dtype: torch.dtype, slots: int) -> TokenRing | None:
        """A ring, or None when shared memory is short (less than ``8 x`` the ring's size
        plus 32 MB free) or cannot be had: the worker then sends its tokens in the messages."""
        nbytes = slots * math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        free = _free_bytes(SHM_DIR)
        if free is not None and free < _SPARE * nbytes + _FLOOR:
            logger.info(
                "%s has %.0f MB free, too little for a %.1f MB token ring: this worker sends "
                "its batches' tokens in the dataloader's messages (a larger --shm-size, or "
                "TokenLoader(shared_tokens=False) to say so)",
                SHM_DIR, free / 2**20, nbytes / 2**20,
            )  # fmt: skip
            return None
        try:
            return cls(shape, dtype, slots)
        except (RuntimeError, OSError) as e:  # e.g. "No space left on device"
            logger.info("no shared-memory token ring (%s): tokens go in the messages", e)
            return None

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"{slots=} must be >= 1")
        self.data = torch.empty((slots, *shape), dtype=dtype).share_memory_()
        self.released = torch.zeros(1, dtype=torch.int64).share_memory_()  # written by the reader
        self.claimed = 0  # slots the writer has claimed, in order (the writer's count)

    @property
    def slots(self) -> int:
        return int(self.data.shape[0])

    def fits(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether a group of this token shape and dtype fits a slot (a shorter last group
        of a finite stream does: it takes the slot's first rows)."""
        slot = tuple(self.data.shape[1:])
        return (
            dtype == self.data.dtype
            and len(shape) == len(slot)
            and shape[0] <= slot[0]
            and shape[1:] == slot[1:]
        )

    def claim(self) -> int | None:
        """Writer: the index of the next free slot, now the writer's to fill, or None when the
        reader has not released enough slots yet (send the tokens in the message instead)."""
        if self.claimed - int(self.released[0]) >= self.slots:
            return None
        slot = self.claimed % self.slots
        self.claimed += 1
        return slot

    def unclaim(self) -> None:
        """Writer: give back the slot :meth:`claim` returned last, unsent (its group did not
        fit it after all); the next claim returns it again."""
        if self.claimed <= int(self.released[0]):
            raise RuntimeError("unclaim() without a claimed, unreleased slot")
        self.claimed -= 1

    def view(self, slot: int, groups: int) -> torch.Tensor:
        """The first ``groups`` batches of ``slot``: the writer fills it, the reader copies
        out of it before :meth:`release`."""
        return self.data[slot, :groups]

    def release(self) -> None:
        """Reader: the oldest claimed slot is read and may be written again."""
        self.released += 1
