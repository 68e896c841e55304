"""The data state of a whole torchft job at a committed step, and a replica's share of it.

A torchft job's data is split among the replica groups taking part in a step (the quorum's
participants): participant ``i`` of ``n`` reads share ``i`` of ``n``, exactly as rank ``i`` of
``n`` would under ``torchrun``. :class:`JobState` holds, after ``step`` committed steps, the
:class:`~torchdata_ext.loader.token_loader.TokenLoader` state of every share. When the number of
participants changes, the new shares are the old states re-split by the same code a checkpoint
restore at another world size runs (:func:`torchdata_ext.checkpoint.restore.restore_loader`, which
calls :mod:`torchdata_ext.checkpoint.rescale`), in this process, from the states in memory.

Between the steps whose states the participants exchange, the states are not sent: a
:class:`JobState` is then the last exchanged (or re-split) states plus ``replay`` committed
steps of ``per_step[i]`` batches of each share ``i`` since, and a share's state now is
rebuilt when needed by restoring the older state and taking those batches again (the
loader's replay is deterministic: the same state gives the same batches).

A share that was re-split but not yet read (its state is "share ``i`` of the re-split of
``base``") is stored as ``None`` with the states it comes from in ``base``, and is computed only
when needed (:func:`share_state`): after a re-split each participant computes its own share only.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torchdata_ext.checkpoint.restore import CHECKPOINT_FORMAT, restore_loader
from torchdata_ext.loader.token_loader import STATE_FORMAT, TokenLoader, unpack_worker_state
from torchdata_ext.state.graph import graph_summary

__all__ = [
    "JOB_FORMAT",
    "JobState",
    "LoaderFactory",
    "Prepare",
    "restore_share",
    "share_state",
]

JOB_FORMAT = 2
"""The format of :meth:`JobState.to_bytes`."""

LoaderFactory = Callable[[int, int], TokenLoader]
"""``(share, shares) -> a new TokenLoader`` at rank ``share`` of ``shares`` (not iterating)."""

Prepare = Callable[[TokenLoader], None]
"""What to do to a restored loader before it takes batches (e.g. the trainer's weight changes
made after its state was taken)."""


@dataclass(frozen=True)
class JobState:
    """The data state of every share of a torchft job after ``step`` committed steps.

    Attributes:
        step: the job's committed steps (torchft's ``Manager.current_step()``).
        states: share ``i``'s ``TokenLoader.state_dict()`` (rank ``i`` of ``len(states)``), or
            None: share ``i`` of ``base`` re-split into ``len(states)`` shares, not yet
            computed (with no ``base``: share ``i`` of a fresh run); all at step
            ``step - replay``.
        base: the job's state the None shares are re-split from, at step ``step - replay``
            (its own shares possibly computed when needed), or None.
        replay: committed steps since ``states``: share ``i``'s state at ``step`` is its state
            in ``states`` after taking ``per_step[i]`` more batches in each of them.
        per_step: batches share ``i`` takes per step (all 1 when None).
    """

    step: int
    states: tuple[dict[str, Any] | None, ...]
    base: JobState | None = None
    replay: int = 0
    per_step: tuple[int, ...] | None = None
    _cache: dict[int, dict[str, Any]] = field(
        default_factory=dict, compare=False, repr=False, hash=False
    )

    def __post_init__(self) -> None:
        if not self.states:
            raise ValueError("a JobState needs at least one share")
        if self.replay < 0 or self.replay > self.step:
            raise ValueError(f"replay={self.replay} must be in 0..step={self.step}")
        if self.per_step is not None and len(self.per_step) != len(self.states):
            raise ValueError(f"per_step={self.per_step} must have one count per share")

    @property
    def at(self) -> int:
        """The step ``states`` (and ``base``) are at: ``step - replay``."""
        return self.step - self.replay

    def batches(self, share: int) -> int:
        """The batches share ``share`` takes after ``states`` to reach ``step``."""
        return self.replay * (1 if self.per_step is None else self.per_step[share])

    def advanced(self, per_step: tuple[int, ...]) -> JobState:
        """This state one committed step later, each share ``i`` having taken
        ``per_step[i]`` batches (replayed when its state is needed)."""
        if self.replay and per_step != self.per_step:
            raise ValueError(f"{per_step=} differs from the replay's {self.per_step}")
        return JobState(self.step + 1, self.states, self.base, self.replay + 1, per_step)

    @property
    def shares(self) -> int:
        """The number of shares (the participants of the step the state is at)."""
        return len(self.states)

    def resplit(self, shares: int) -> JobState:
        """This state re-split into ``shares`` shares (lazily: each computed when needed)."""
        if shares < 1:
            raise ValueError(f"{shares=} must be >= 1")
        if self.base is None and not self.replay and all(s is None for s in self.states):
            return JobState(self.step, (None,) * shares)  # a fresh run
        return JobState(self.step, (None,) * shares, self)

    def complete(self, make: LoaderFactory, prepare: Prepare | None = None) -> JobState:
        """This state with every share computed at ``step`` (itself if they are)."""
        if not self.replay and all(s is not None for s in self.states):
            return self
        return JobState(
            self.step, tuple(share_state(self, i, make, prepare) for i in range(self.shares))
        )

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
        "replay": job.replay,
        "per_step": None if job.per_step is None else list(job.per_step),
    }


def _from_plain(plain: dict[str, Any]) -> JobState:
    base = plain["base"]
    per_step = plain["per_step"]
    return JobState(
        int(plain["step"]),
        tuple(plain["states"]),
        None if base is None else _from_plain(base),
        int(plain["replay"]),
        None if per_step is None else tuple(int(c) for c in per_step),
    )


def restore_share(
    job: JobState, share: int, make: LoaderFactory, prepare: Prepare | None = None
) -> TokenLoader:
    """A new ``TokenLoader`` for ``share`` of ``job`` (rank ``share`` of ``job.shares``) at
    ``job.step``, restored and not yet iterating: from the share's own state if known, else
    re-split from ``job.base`` (reading only the states of the old shares it succeeds), then
    (``job.replay`` > 0) its batches since taken again. ``prepare`` is applied to each loader
    restored before it takes batches.

    Raises:
        ValueError: ``share`` out of range, or a state that does not fit the loader's pipeline
            (the restore's own checks: other data, seed or logical shards).
    """
    if not 0 <= share < job.shares:
        raise ValueError(f"{share=} must be in 0..{job.shares - 1}")
    if job.replay:  # the share's state at job.step, then a loader restored from it alone
        states: list[dict[str, Any] | None] = [None] * job.shares
        states[share] = share_state(job, share, make, prepare)
        return _restored(make, share, job.shares, states, job.step, prepare)
    own = job.states[share]
    if own is not None:  # the same shares: only its own state is read
        return _restored(make, share, job.shares, job.states, job.step, prepare)
    if job.base is not None:
        return _restored(make, share, job.shares, _Lazy(job.base, make, prepare), job.at, prepare)
    return _restored(make, share, job.shares, None, job.step, prepare)  # a fresh share


def _restored(
    make: LoaderFactory,
    share: int,
    shares: int,
    states: Sequence[dict[str, Any] | None] | None,
    step: int,
    prepare: Prepare | None,
) -> TokenLoader:
    loader = make(share, shares)
    if (loader.rank, loader.world_size) != (share, shares):
        raise ValueError(
            f"the loader factory made rank {loader.rank} of {loader.world_size} when asked for "
            f"{share} of {shares}; pass rank= and world_size= to TokenLoader"
        )
    if states is not None:
        restore_from_states(loader, states, step)
    if prepare is not None:
        prepare(loader)
    return loader


class _Lazy(Sequence[dict[str, Any] | None]):
    """The shares' states of a job, each computed when first read (:func:`share_state`)."""

    def __init__(self, job: JobState, make: LoaderFactory, prepare: Prepare | None) -> None:
        self.job, self.make, self.prepare = job, make, prepare

    def __len__(self) -> int:
        return self.job.shares

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return share_state(self.job, i, self.make, self.prepare)


def share_state(
    job: JobState, share: int, make: LoaderFactory, prepare: Prepare | None = None
) -> dict[str, Any]:
    """Share ``share``'s loader state at ``job.step`` (computed from ``job.base`` if not
    known, and its batches since ``job.states`` replayed; kept once computed)."""
    own = job.states[share]
    if own is not None and not job.replay:
        return own
    if share in job._cache:
        return job._cache[share]
    start = JobState(job.at, job.states, job.base)
    loader = restore_share(start, share, make, prepare)
    try:
        if job.batches(share):
            it = iter(loader)
            for _ in range(job.batches(share)):
                if next(it, None) is None:
                    break
        state = loader.state_dict()
    finally:
        loader.close()
    job._cache[share] = state
    return state


def restore_from_states(
    loader: TokenLoader, states: Sequence[dict[str, Any] | None], step: int
) -> None:
    """Restore ``loader`` (not iterating) from the in-memory ``state_dict()`` of every rank of
    a run (``states[r]``: rank ``r`` of ``len(states)``; None: not known, must not be needed),
    as a checkpoint of them would: the same world size restores rank ``loader.rank``'s own
    state, another one rescales (reading the states of the old ranks it succeeds)."""
    # the old share this one starts in first (a needed one: a lazy state is computed once)
    first = states[min(loader.rank * len(states) // loader.world_size, len(states) - 1)]
    if first is None:
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
        # a state taken before a trainer's set_weights call lacks it, one after has it (the
        # caller re-applies the calls, ``prepare``): read every rank with the manifest's
        rank_meta=lambda r: {**_needed(states, r), "weight_changes": first["weight_changes"]},
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
