"""Every participant's bytes to every participant, through torchft's fault-tolerant all-reduce.

torchft's ``Manager`` offers one collective across replica groups, ``allreduce``: it runs on
the quorum's process group, zeroes the tensor of a replica that does not take part in the step
(one healing, a spare), and on any failure (a peer died) swallows the error, reports it to the
manager (so the step does not commit: ``should_commit()`` is False) and leaves the tensor
undefined. :func:`start_allgather` builds an all-gather on it, an all-reduce of a ``uint8``
tensor of ``slots x (16 + capacity)`` bytes (``capacity`` given, or the longest slot's, found
by an all-reduce of the lengths first): each participant writes its bytes, after their
length and crc32, into its own slot of a zero tensor, and the sum is everyone's bytes.
:meth:`Gathering.result` waits for it; call it in the same step (torchft reports the
collective's error to the manager when it is waited for, and a new quorum clears it).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.distributed import ReduceOp

__all__ = ["Collective", "Gathering", "start_allgather"]

_HEADER = 16  # a slot's length + 1 (0: nothing in the slot) and crc32, little-endian u64s


class Collective(Protocol):
    """The part of ``torchft.Manager`` the exchange uses."""

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = ..., reduce_op: Any = ...
    ) -> Any:
        """Start a fault-tolerant all-reduce of ``tensor`` in place; returns a work to wait."""

    def errored(self) -> Any:
        """The error reported in this step, or None."""


@dataclass
class Gathering:
    """A started :func:`start_allgather`."""

    manager: Collective
    work: Any
    buf: torch.Tensor | None
    slots: int
    capacity: int
    _result: list[bytes | None] | None = None
    _waited: bool = False

    def result(self) -> list[bytes | None] | None:
        """Every slot's bytes (None: nobody wrote it), or None if the collective failed (the
        manager then has the error and the step does not commit; each slot carries its crc32,
        so a tensor a failed collective left undefined is never read as states). Waits."""
        if not self._waited:
            self._result, self._waited = self._wait(), True
        return self._result

    def _wait(self) -> list[bytes | None] | None:
        if self.buf is None:
            return None
        self.work.wait()  # torchft reports an error of it to the manager: wait in its step
        if self.manager.errored() is not None:
            return None
        raw = self.buf.numpy().reshape(self.slots, _HEADER + self.capacity)
        out: list[bytes | None] = []
        for row in raw:
            n, crc = np.frombuffer(row[:_HEADER].tobytes(), "<u8").tolist()
            if n > self.capacity + 1:
                return None  # a failed collective leaves the tensor undefined
            data = row[_HEADER : _HEADER + n - 1].tobytes() if n else None
            if data is not None and zlib.crc32(data) != crc:
                return None
            out.append(data)
        return out


def start_allgather(
    manager: Collective, mine: bytes | None, slot: int | None, slots: int, capacity: int | None
) -> Gathering:
    """Start gathering every slot's bytes: ``mine`` at ``slot`` (None: this replica
    contributes nothing), the other participants' at theirs.

    Args:
        manager: the torchft ``Manager`` (or anything with its ``allreduce`` and ``errored``).
        mine: this replica's bytes, or None.
        slot: this replica's slot (its participating rank), or None.
        slots: the number of slots (the step's participants); the same on every replica.
        capacity: bytes a slot holds, the same on every replica; None: as many as the
            longest slot's, found by a first all-reduce of the lengths (``slots`` int64s,
            waited for here).

    Raises:
        ValueError: ``mine`` is longer than ``capacity`` (after the collective started, with
            this slot empty, so the peers do not wait for it).
    """
    if slot is not None and not 0 <= slot < slots:
        raise ValueError(f"{slot=} must be in 0..{slots - 1}")
    if capacity is None:
        lengths = torch.zeros(slots, dtype=torch.int64)
        if mine is not None and slot is not None:
            lengths[slot] = len(mine)
        if manager.errored() is None:
            manager.allreduce(lengths, reduce_op=ReduceOp.SUM).wait()
        capacity = max(0, int(lengths.max()))
    if manager.errored() is not None:
        return Gathering(manager, None, None, slots, capacity)
    buf = torch.zeros(slots * (_HEADER + capacity), dtype=torch.uint8)
    fits = mine is not None and slot is not None and len(mine) <= capacity
    if fits:
        assert mine is not None and slot is not None
        at = slot * (_HEADER + capacity)
        header = np.asarray([len(mine) + 1, zlib.crc32(mine)], "<u8").tobytes()
        buf[at : at + _HEADER + len(mine)] = torch.frombuffer(
            bytearray(header + mine), dtype=torch.uint8
        )
    work = manager.allreduce(buf, reduce_op=ReduceOp.SUM)
    if mine is not None and slot is not None and not fits:
        raise ValueError(
            f"this replica group's data state is {len(mine)} bytes, more than "
            f"exchange_capacity={capacity}; raise ElasticLoader's exchange_capacity"
        )
    return Gathering(manager, work, buf, slots, capacity)
