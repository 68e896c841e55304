"""The data state of a whole torchft job at a committed step, and a replica's share of it.

A torchft job's data is split among the replica groups taking part in a step (the quorum's
participants): participant ``i`` of ``n`` reads share ``i`` of ``n``, exactly as rank ``i`` of
``n`` would under ``torchrun``. :class:`JobState` holds, after ``step`` committed steps, the
:class:`~torchdata_ext.loader.token_loader.TokenLoader` state of every share. When the number of
participants changes, the new shares are the old states re-split by the same code a checkpoint
restore at another world size runs (:func:`torchdata_ext.checkpoint.restore.restore_loader`, which
calls :mod:`torchdata_ext.checkpoint.rescale`), in this process, from the states in memory.

A share that was re-split but not yet read (its state is "share ``i`` of the re-split of
``base``") is stored as ``None`` with the states it comes from in ``base``, and is computed only
when needed (:func:`share_state`): after a re-split each participant computes its own share only.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torchdata_ext.checkpoint.restore import CHECKPOINT_FORMAT, restore_loader
from torchdata_ext.loader.token_loader import STATE_FORMAT, TokenLoader, unpack_worker_state
from torchdata_ext.state.graph import graph_summary

__all__ = ["JOB_FORMAT", "JobState", "LoaderFactory", "restore_share", "share_state"]

JOB_FORMAT = 1
"""The format of :meth:`JobState.to_bytes`."""

LoaderFactory = Callable[[int, int], TokenLoader]
"""``(share, shares) -> a new TokenLoader`` at rank ``share`` of ``shares`` (not iterating)."""


@dataclass(frozen=True)
class JobState:
    """The data state of every share of a torchft job after ``step`` committed steps.

    Attributes:
        step: the job's committed steps (torchft's ``Manager.current_step()``).
        states: share ``i``'s ``TokenLoader.state_dict()`` (rank ``i`` of ``len(states)``), or
            None: share ``i`` of ``base`` re-split into ``len(states)`` shares, not yet
            computed (with no ``base``: share ``i`` of a fresh run).
        base: the states the None shares are re-split from (every share known), or None.
    """

    step: int
    states: tuple[dict[str, Any] | None, ...]
    base: JobState | None = None

    def __post_init__(self) -> None:
        if not self.states:
            raise ValueError("a JobState needs at least one share")
        if self.base is not None and any(s is None for s in self.base.states):
            raise ValueError("a JobState's base must have every share computed")

    @property
    def shares(self) -> int:
        """The number of shares (the participants of the step the state is at)."""
        return len(self.states)

    def resplit(self, shares: int, make: LoaderFactory) -> JobState:
        """This state re-split into ``shares`` shares (lazily: each computed when needed)."""
        if shares < 1:
            raise ValueError(f"{shares=} must be >= 1")
        if self.base is None and all(s is None for s in self.states):  # a fresh run
            return JobState(self.step, (None,) * shares)
        return JobState(self.step, (None,) * shares, self.complete(make))

    def complete(self, make: LoaderFactory) -> JobState:
        """This state with every share computed (itself if they are)."""
        if all(s is not None for s in self.states):
            return self
        return JobState(self.step, tuple(share_state(self, i, make) for i in range(self.shares)))

    def to_bytes(self) -> bytes:
        """The state as bytes (a pickle of plain dicts, lists, numbers and arrays)."""
        return pickle.dumps(
            {"format": JOB_FORMAT, **_plain(self)}, protocol=pickle.HIGHEST_PROTOCOL
        )

    @staticmethod
    def from_bytes(data: bytes) -> JobState:
        """The inverse of :meth:`to_bytes`.

        Raises:
            ValueError: ``data`` is not a JobState of this format.
        """
        plain = pickle.loads(data)
        if not isinstance(plain, dict) or plain.get("format") != JOB_FORMAT:
            raise ValueError(
                "not a torchdata_ext.torchft job state of format "
                f"{JOB_FORMAT} (got {plain.get('format') if isinstance(plain, dict) else plain!r})"
            )
        return _from_plain(plain)


def _plain(job: JobState) -> dict[str, Any]:
    return {
        "step": job.step,
        "states": list(job.states),
        "base": None if job.base is None else _plain(job.base),
    }


def _from_plain(plain: dict[str, Any]) -> JobState:
    base = plain["base"]
    return JobState(
        int(plain["step"]), tuple(plain["states"]), None if base is None else _from_plain(base)
    )


def restore_share(job: JobState, share: int, make: LoaderFactory) -> TokenLoader:
    """A new ``TokenLoader`` for ``share`` of ``job`` (rank ``share`` of ``job.shares``),
    restored and not yet iterating: from the share's own state if known, else re-split from
    ``job.base`` (reading only the states of the old shares it succeeds).

    Raises:
        ValueError: ``share`` out of range, or a state that does not fit the loader's pipeline
            (the restore's own checks: other data, seed or logical shards).
    """
    if not 0 <= share < job.shares:
        raise ValueError(f"{share=} must be in 0..{job.shares - 1}")
    loader = make(share, job.shares)
    if (loader.rank, loader.world_size) != (share, job.shares):
        raise ValueError(
            f"the loader factory made rank {loader.rank} of {loader.world_size} when asked for "
            f"{share} of {job.shares}; pass rank= and world_size= to TokenLoader"
        )
    own = job.states[share]
    if own is not None:  # the same shares: only its own state is read
        restore_from_states(loader, job.states, job.step)
    elif job.base is not None:
        restore_from_states(loader, job.base.states, job.step)
    # else: a fresh share, as the loader starts
    return loader


def share_state(job: JobState, share: int, make: LoaderFactory) -> dict[str, Any]:
    """Share ``share``'s loader state (computed from ``job.base`` if not known)."""
    own = job.states[share]
    if own is not None:
        return own
    loader = restore_share(job, share, make)
    try:
        return loader.state_dict()
    finally:
        loader.close()


def restore_from_states(
    loader: TokenLoader, states: Sequence[dict[str, Any] | None], step: int
) -> None:
    """Restore ``loader`` (not iterating) from the in-memory ``state_dict()`` of every rank of
    a run (``states[r]``: rank ``r`` of ``len(states)``; None: not known, must not be needed),
    as a checkpoint of them would: the same world size restores rank ``loader.rank``'s own
    state, another one rescales (reading the states of the old ranks it succeeds)."""
    first = next((s for s in states if s is not None), None)
    if first is None:
        raise ValueError("restoring needs the state of at least one rank")
    if first.get("format") != STATE_FORMAT:
        raise ValueError(f"not a TokenLoader state (format={first.get('format')!r})")
    workers = int(first["num_workers"])
    any_graph = unpack_worker_state(next(iter(first["workers"].values())))["graph"]
    # in-process states of one job: its weights are the ones its states carry (no check needed)
    datasets = {
        name: {**summary, "weight": None} for name, summary in graph_summary(any_graph).items()
    }
    manifest = {
        "format": CHECKPOINT_FORMAT,
        "loader_format": STATE_FORMAT,
        "world_size": len(states),
        "num_workers": workers,
        "step": step,
        "skip_steps": first["skip_steps"],
        "weight_changes": first["weight_changes"],
        "weight_schedule": first["weight_schedule"],
        "datasets": datasets,
    }

    def worker(g: int, meta: dict[str, Any]) -> dict[str, Any]:
        graph: dict[str, Any] = unpack_worker_state(meta["workers"][str(g)])["graph"]
        return graph

    restore_loader(
        loader,
        manifest,
        f"the job's data state at step {step}",
        rank_meta=lambda r: _needed(states, r),
        worker=worker,
        check_files=lambda *_: None,  # the same files, read by the same job
        allow_weight_changes=False,
        allow_new_datasets=False,
    )


def _needed(states: Sequence[dict[str, Any] | None], r: int) -> dict[str, Any]:
    state = states[r]
    if state is None:
        raise ValueError(f"restoring needs share {r}'s state, which is not computed")
    return state
