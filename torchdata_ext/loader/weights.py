"""Weights changed by the trainer during the run (:meth:`TokenLoader.set_weights`).

A change ``(S, weights)`` means: the batches from step ``S`` on come from the pipeline's state
after step ``S - 1``, rebuilt with the new weights. The loader applies it when the training
loop has taken batch ``S - 1``: it takes its exact state there, builds every worker's graph
with the new weights and restarts the workers from that state (the path of
``load_state_dict``), so the change lands at a definite step whatever the workers had made
ahead, and a restore or a rescale from any checkpoint replays it: the changes are recorded in
the loader state and in the checkpoint's manifest, and a restore builds with the weights in
force at its step. The interleave counts the tokens so far as if mixed at the new weights
(:meth:`~torchdata_ext.nodes.interleave.Interleave`), so the new mix holds from ``S`` without
first making up for the old one. The rows the pipeline already holds at ``S - 1`` (its shuffle
buffer, the packer's open row) were mixed before and are delivered as they are: the share in
the delivered batches moves to the new weights over about ``shuffle_buffer / batch_size``
steps of each worker.

A config's ``weight_schedule`` is realised by the same changes: :class:`ScheduleRecord` turns
its points (steps, or global tokens through the run's tokens per step) into ``[step, weights]``
changes, a linear ramp into a change every ``ramp_every`` steps. The trainer's calls and the
schedule's changes are kept apart (a rescale with another global batch moves a token-keyed
point to another step; the trainer's calls stay where they were made); at a step the later
of the two applies, the trainer's call at a tie.

This module holds the pure parts: checking a change, recording it, the schedule's changes,
and the build function with other weights.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ScheduleRecord",
    "WeightChanges",
    "check_ranks_agree",
    "check_weights",
    "is_pipeline_config",
    "with_weights",
]


def check_weights(cfg: Any, weights: Mapping[str, float]) -> dict[str, float]:
    """``weights`` checked against config ``cfg``: one finite weight > 0 per dataset
    (:func:`~torchdata_ext.pipeline.schedule.checked_weights`, as a schedule's entries).

    Raises:
        TypeError: ``weights`` is not a mapping ``name -> number``.
        ValueError: a dataset missing or unknown, a weight <= 0 or not finite, or a config
            this cannot change (curriculum phases, ``pack_mode="best_fit"``).
    """
    # imported here: the pipeline package (its builder) is not needed to run a loader
    from torchdata_ext.pipeline.schedule import checked_weights, refuse_weight_changes

    if not isinstance(weights, Mapping):
        raise TypeError(
            f"set_weights: weights={weights!r} must be a mapping dataset name -> weight, e.g. "
            '{"web": 0.5, "code": 0.5}'
        )
    out = checked_weights(weights, list(cfg.dataset_weights), "set_weights")
    refuse_weight_changes(cfg, "set_weights")
    return out


def check_ranks_agree(step: Any, weights: Any, world_size: int) -> None:
    """Refuse a ``set_weights(weights, from_step=step)`` call that the other ranks did not make
    identically, when ``torch.distributed`` is initialised with ``world_size`` (> 1) ranks.

    A collective (one ``all_gather_object`` of ``(step, weights)``): every rank must call
    ``set_weights`` at the same point of its loop, as a trainer does with weights computed from
    an all-reduced loss (a rank that makes no call leaves the others waiting in the gather
    until the process group's timeout). Without a process group of ``world_size`` ranks it
    does nothing (a restore still refuses a checkpoint whose ranks recorded other changes).

    Raises:
        ValueError: the ranks asked for different steps or weights (every rank raises, naming
            each rank that differs from rank 0 and what each asked for).
    """
    import torch.distributed as dist

    if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() != world_size:
        return
    mine = [step, dict(weights) if isinstance(weights, Mapping) else repr(weights)]
    calls: list[Any] = [None] * world_size
    dist.all_gather_object(calls, mine)
    differ = [r for r, c in enumerate(calls) if c != calls[0]]
    if differ:
        asked = "; ".join(
            f"rank {r}: from_step={c[0]} weights={c[1]}" for r, c in enumerate(calls)
            if r == 0 or r in differ
        )  # fmt: skip
        raise ValueError(
            f"set_weights: the ranks asked for different changes ({asked}); every rank must "
            "make the same call at the same step (e.g. weights computed from an all-reduced "
            "loss, or on rank 0 and broadcast); no rank changed its mix"
        )


def is_pipeline_config(arg: Any) -> bool:
    """Whether ``arg`` is a ``PipelineConfig`` (told by its fields: a build function's
    arguments are looked through without importing the config module)."""
    return hasattr(arg, "data_path") and hasattr(arg, "skip_steps")


def with_weights(build: Any, weights: Mapping[str, float]) -> Any:
    """``build`` (a ``functools.partial`` given a ``PipelineConfig``) with the config's weights
    replaced by ``weights`` (name -> weight); everything else as it was."""

    def swap(arg: Any) -> Any:
        if is_pipeline_config(arg):
            return dataclasses.replace(arg, weights=[weights[n] for n in arg.dataset_weights])
        return arg

    args = tuple(swap(a) for a in build.args)
    keywords = {k: swap(v) for k, v in build.keywords.items()}
    return functools.partial(build.func, *args, **keywords)


@dataclasses.dataclass
class WeightChanges:
    """The weight changes of a run, ``[[step, {name: weight}], ...]`` by step: the trainer's
    calls and the config schedule's changes.

    Attributes:
        changes: every :meth:`TokenLoader.set_weights` call of the run (applied or still
            due), sorted by step.
        original: the build function as the loader was given it (the config's own weights).
        scheduled: the config's ``weight_schedule`` as changes (:meth:`ScheduleRecord.changes`).
    """

    changes: list[list[Any]] = dataclasses.field(default_factory=list)
    original: Any = None
    scheduled: list[list[Any]] = dataclasses.field(default_factory=list)

    def add(self, step: int, weights: dict[str, float]) -> None:
        """Record ``weights`` from ``step`` (a later call for the same step replaces it)."""
        self.changes = [c for c in self.changes if c[0] != step] + [[int(step), dict(weights)]]
        self.changes.sort(key=lambda c: c[0])

    def in_force(self, step: int) -> dict[str, float] | None:
        """The weights of the last change that applies to batch ``step`` (None: the config's):
        the later of the trainer's and the schedule's, the trainer's at the same step."""
        due = [c for c in self.scheduled if c[0] <= step][-1:]
        due += [c for c in self.changes if c[0] <= step][-1:]
        due.sort(key=lambda c: c[0])  # stable: the trainer's call last at a tie
        return dict(due[-1][1]) if due else None

    def due_at(self, step: int) -> bool:
        """Whether a change (the trainer's or the schedule's) takes effect at batch ``step``."""
        return any(c[0] == step for c in (*self.changes, *self.scheduled))

    def points(self) -> list[list[Any]]:
        """Every change of the run in step order, ``[step, weights, "trainer" | "schedule"]``
        (the segments an audit compares against)."""
        both = [[c[0], dict(c[1]), "schedule"] for c in self.scheduled]
        both += [[c[0], dict(c[1]), "trainer"] for c in self.changes]
        return sorted(both, key=lambda c: (c[0], c[2] == "trainer"))

    def build_for(self, step: int) -> Any:
        """The build function for batch ``step``: the original one, with the weights in force."""
        weights = self.in_force(step)
        return self.original if weights is None else with_weights(self.original, weights)

    @classmethod
    def of_state(cls, state: Mapping[str, Any], build: Any) -> WeightChanges:
        """The changes a loader state recorded (the trainer's and its schedule's, as the
        loader that saved or restored it placed them), with ``build`` the original build."""
        out = cls(original=build)
        out.changes = cls.checked(state.get("weight_changes", []), "the loader state")
        record = ScheduleRecord.of_state(state.get("weight_schedule", []), "the loader state")
        out.scheduled = record.changes()
        return out

    @staticmethod
    def checked_points(points: Sequence[Sequence[Any]], where: str) -> list[list[Any]]:
        """A schedule's ``[[at, weights], ...]`` as recorded (``at``: a step or a token count)."""
        out = []
        for p in points:
            if not (len(p) == 2 and isinstance(p[0], int | float) and isinstance(p[1], Mapping)):
                raise ValueError(f"{where}: weight_schedule entry {p!r} is not [at, weights]")
            at = int(p[0]) if float(p[0]).is_integer() else float(p[0])
            out.append([at, {str(k): float(v) for k, v in p[1].items()}])
        return sorted(out, key=lambda p: p[0])

    @staticmethod
    def checked(changes: Sequence[Sequence[Any]], where: str) -> list[list[Any]]:
        """``changes`` as recorded in a state or manifest, checked."""
        out = []
        for c in changes:
            ok = len(c) == 2 and isinstance(c[0], int) and isinstance(c[1], Mapping)
            if not ok:
                raise ValueError(f"{where}: weight_changes entry {c!r} is not [step, weights]")
            out.append([int(c[0]), {str(k): float(v) for k, v in c[1].items()}])
        return sorted(out, key=lambda c: c[0])


@dataclasses.dataclass
class ScheduleRecord:
    """A config's ``weight_schedule`` as the loader records it, and the changes that realise it.

    Attributes:
        points: ``[[at, {name: weight}], ...]`` sorted by ``at``: the weights from step ``at``
            (``unit="steps"``) or from global token ``at`` (``unit="tokens"``: the batch
            positions of every rank, ``world_size x batch_size x seq_length`` a step).
        unit: ``"steps"`` or ``"tokens"``.
        ramp_every: 0: piecewise constant; ``N >= 1``: linear between points, as a change
            every ``N`` steps (each a restart of the workers: see the module docstring).
        step_tokens: ``[[from_step, global tokens per step], ...]``: the run's global batch in
            tokens from each step on (a restore with another one adds an entry), so a token
            point falls on the same step whatever happened after it was passed.
    """

    points: list[list[Any]] = dataclasses.field(default_factory=list)
    unit: str = "steps"
    ramp_every: int = 0
    step_tokens: list[list[int]] = dataclasses.field(default_factory=list)

    @classmethod
    def of_config(cls, cfg: Any, world_size: int) -> ScheduleRecord:
        """The schedule of config ``cfg`` (checked by it) on ``world_size`` ranks."""
        per_step = int(world_size) * int(cfg.batch_size) * int(cfg.seq_length)
        return cls(
            points=[[p[0], dict(p[1])] for p in cfg.weight_schedule or []],
            unit=str(getattr(cfg, "weight_schedule_unit", "steps")),
            ramp_every=int(getattr(cfg, "weight_schedule_ramp_every", 0)),
            step_tokens=[[1, per_step]],
        )

    @classmethod
    def of_state(cls, saved: Any, where: str) -> ScheduleRecord:
        """The record saved in a loader state or manifest (a list of ``[step, weights]``:
        the step-keyed form of earlier versions)."""
        if isinstance(saved, Mapping):
            return cls(
                points=WeightChanges.checked_points(saved.get("points", []), where),
                unit=str(saved.get("unit", "steps")),
                ramp_every=int(saved.get("ramp_every", 0)),
                step_tokens=[[int(a), int(n)] for a, n in saved.get("step_tokens", [])],
            )
        return cls(points=WeightChanges.checked_points(saved or [], where))

    def as_state(self) -> dict[str, Any]:
        """The record as a loader state keeps it (plain JSON)."""
        return {
            "points": [[p[0], dict(p[1])] for p in self.points],
            "unit": self.unit,
            "ramp_every": self.ramp_every,
            "step_tokens": [list(e) for e in self.step_tokens],
        }

    def same_schedule(self, other: ScheduleRecord) -> bool:
        """Whether the two are the same schedule (the run's global batch aside)."""
        mine = (self.points, self.unit, self.ramp_every) if self.points else None
        theirs = (other.points, other.unit, other.ramp_every) if other.points else None
        return mine == theirs

    def describe(self) -> str:
        """The schedule for a message: its points, unit and ramp."""
        if not self.points:
            return "no weight_schedule"
        ramp = f", linear every {self.ramp_every} steps" if self.ramp_every else ""
        return f"{self.points} (in {self.unit}{ramp})"

    def resumed_at(self, step: int, per_step: int) -> None:
        """The run goes on after ``step`` with ``per_step`` global tokens a step (a restore,
        maybe with other ranks or batch size)."""
        if not self.step_tokens:
            self.step_tokens = [[1, int(per_step)]]
        if self.step_tokens[-1][1] == per_step:
            return
        # an entry from step + 1 on (a restore here before) gives way to this one
        self.step_tokens = [e for e in self.step_tokens if e[0] <= step]
        self.step_tokens.append([int(step) + 1, int(per_step)])

    def tokens_before(self, step: int) -> int:
        """Global tokens delivered before batch ``step`` (its first token's position)."""
        total = 0
        for i, (a, rate) in enumerate(self.step_tokens):
            end = self.step_tokens[i + 1][0] if i + 1 < len(self.step_tokens) else step
            total += max(0, min(end, step) - a) * rate
        return total

    def step_of(self, at: float) -> int:
        """The first step whose batch starts at or after point ``at`` (in the unit)."""
        if self.unit == "steps":
            return max(1, int(at))
        seen = 0
        for i, (a, rate) in enumerate(self.step_tokens):
            nxt = self.step_tokens[i + 1][0] if i + 1 < len(self.step_tokens) else None
            if nxt is None or at < seen + (nxt - a) * rate:
                return a + max(0, -(-(int(at) - seen) // rate))
            seen += (nxt - a) * rate
        raise AssertionError("unreachable: the last entry of step_tokens is open")

    def _position(self, step: int) -> float:
        return float(step) if self.unit == "steps" else float(self.tokens_before(step))

    def changes(self) -> list[list[Any]]:
        """``[[step, weights], ...]``: the loader changes that realise the schedule. A point's
        weights apply from :meth:`step_of` it; with ``ramp_every`` the shares (weights over
        their sum) go linearly from each point to the next, set at every ``ramp_every``-th
        step from the point's step, each stair taking the value at its first batch."""
        out: dict[int, dict[str, float]] = {}
        pts = self.points
        for i, (at, weights) in enumerate(pts):
            start = self.step_of(at)
            out[start] = dict(weights)
            if not self.ramp_every or i + 1 == len(pts):
                continue
            nxt_at, nxt_w = pts[i + 1]
            a, b = _shares(weights), _shares(nxt_w)
            stop = self.step_of(nxt_at)
            for s in range(start + self.ramp_every, stop, self.ramp_every):
                f = (self._position(s) - at) / (nxt_at - at)
                f = min(1.0, max(0.0, f))
                out[s] = {n: (1 - f) * a[n] + f * b[n] for n in a}
        return [[s, out[s]] for s in sorted(out)]


def _shares(weights: Mapping[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {n: w / total for n, w in weights.items()}
