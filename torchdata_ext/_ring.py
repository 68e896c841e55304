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
"""

from __future__ import annotations

import torch

__all__ = ["TokenRing"]


class TokenRing:
    """``slots`` token tensors of one ``shape`` and ``dtype`` in shared memory, and a count
    of the slots the reader has released.

    Args:
        shape: one slot's token tensor shape (``[G, B, size]``).
        dtype: the tokens' dtype.
        slots: how many groups can be in flight at once (the dataloader's prefetch, plus the
            one being read and the one being written).
    """

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

    def view(self, slot: int, groups: int) -> torch.Tensor:
        """The first ``groups`` batches of ``slot``: the writer fills it, the reader copies
        out of it before :meth:`release`."""
        return self.data[slot, :groups]

    def release(self) -> None:
        """Reader: the oldest claimed slot is read and may be written again."""
        self.released += 1
