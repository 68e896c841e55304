"""Every participant's bytes to every participant, through torchft's fault-tolerant all-reduce.

torchft's ``Manager`` offers one collective across replica groups, ``allreduce``: it runs on
the quorum's process group, zeroes the tensor of a replica that does not take part in the step
(one healing, a spare), and on any failure (a peer died) swallows the error, reports it to the
manager (so the step does not commit: ``should_commit()`` is False) and leaves the tensor
undefined. :func:`allgather_bytes` builds an all-gather on it: each participant writes its
bytes into its own slot of a zero tensor and the sum is everyone's bytes. Two rounds: the
lengths (8 bytes a slot), then the bytes.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.distributed import ReduceOp

__all__ = ["Collective", "allgather_bytes"]


class Collective(Protocol):
    """The part of ``torchft.Manager`` the exchange uses."""

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = ..., reduce_op: Any = ...
    ) -> Any:
        """Start a fault-tolerant all-reduce of ``tensor`` in place; returns a work to wait."""

    def errored(self) -> Any:
        """The error reported in this step, or None."""


def allgather_bytes(
    manager: Collective, mine: bytes | None, slot: int | None, slots: int
) -> list[bytes | None] | None:
    """Every slot's bytes: ``mine`` at ``slot`` (None: this replica contributes nothing),
    the other participants' at theirs; a slot nobody wrote is None.

    Args:
        manager: the torchft ``Manager`` (or anything with its ``allreduce`` and ``errored``).
        mine: this replica's bytes, or None.
        slot: this replica's slot (its participating rank), or None.
        slots: the number of slots (the step's participants); the same on every replica.

    Returns:
        the bytes by slot, or None if the collective failed (the manager then has the error
        and the step does not commit).
    """
    if slot is not None and not 0 <= slot < slots:
        raise ValueError(f"{slot=} must be in 0..{slots - 1}")
    if manager.errored() is not None:
        return None
    lengths = torch.zeros(slots, dtype=torch.int64)
    if mine is not None and slot is not None:
        lengths[slot] = len(mine) + 1  # 0: no bytes in this slot
    manager.allreduce(lengths, reduce_op=ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return None
    sizes = [max(0, int(n) - 1) for n in lengths.tolist()]
    starts = [sum(sizes[:i]) for i in range(slots)]
    buf = torch.zeros(max(1, sum(sizes)), dtype=torch.uint8)
    if mine is not None and slot is not None and mine:
        buf[starts[slot] : starts[slot] + len(mine)] = torch.frombuffer(
            bytearray(mine), dtype=torch.uint8
        )
    manager.allreduce(buf, reduce_op=ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return None
    data = buf.numpy().tobytes()
    return [
        data[starts[i] : starts[i] + sizes[i]] if int(lengths[i]) > 0 else None
        for i in range(slots)
    ]
