"""Who am I: the immutable (rank, world size, worker, number of workers) of a reader."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["World"]


@dataclass(frozen=True)
class World:
    """Where a pipeline copy runs among all copies of a job.

    Args:
        rank: this process's rank in ``[0, world_size)`` (torch.distributed rank).
        world_size: the number of ranks.
        worker_id: this dataloader worker's id in ``[0, num_workers)``.
        num_workers: dataloader workers per rank; 0 (loading in the main process) counts as 1.

    The global worker id is ``rank * num_workers + worker_id``; there are
    ``world_size * num_workers`` global workers.
    """

    rank: int = 0
    world_size: int = 1
    worker_id: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "worker_id", "num_workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"World.{name}={v!r} must be an integer")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {self.rank=}, {self.world_size=}")
        if self.num_workers < 1 or not 0 <= self.worker_id < self.num_workers:
            raise ValueError(
                f"need 0 <= worker_id < num_workers, got {self.worker_id=}, {self.num_workers=}"
            )

    @property
    def global_worker(self) -> int:
        """This copy's id among all global workers."""
        return self.rank * self.num_workers + self.worker_id

    @property
    def total_workers(self) -> int:
        """The number of global workers (ranks x dataloader workers)."""
        return self.world_size * self.num_workers

    @classmethod
    def detect(cls, rank: int | None = None, world_size: int | None = None) -> World:
        """The current world: rank and world size from ``torch.distributed`` when initialised
        (else the arguments, else 0 of 1), worker id and count from the dataloader worker info
        (else 0 of 1)."""
        import torch.distributed as dist
        from torch.utils.data import get_worker_info

        if rank is None or world_size is None:
            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank() if rank is None else rank
                world_size = dist.get_world_size() if world_size is None else world_size
            else:
                if world_size is None and isinstance(rank, int) and rank >= 1:
                    raise ValueError(
                        f"rank={rank} needs world_size, which was not given (and no "
                        "torch.distributed process group is initialised to give it, so it "
                        f"would be 1); pass world_size=... (> {rank}) as well"
                    )
                rank = 0 if rank is None else rank
                world_size = 1 if world_size is None else world_size
        info = get_worker_info()
        if info is None:
            return cls(rank, world_size, 0, 1)
        return cls(rank, world_size, info.id, info.num_workers)
