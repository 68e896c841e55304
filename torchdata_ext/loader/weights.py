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

This module holds the pure parts: checking a change, recording it, and the build function
with other weights.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
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
    """The trainer's weight changes of a run, ``[[step, {name: weight}], ...]`` by step.

    Attributes:
        changes: every change made in the run (applied or still due), sorted by step.
        original: the build function as the loader was given it (the config's own weights).
    """

    changes: list[list[Any]] = dataclasses.field(default_factory=list)
    original: Any = None

    def add(self, step: int, weights: dict[str, float]) -> None:
        """Record ``weights`` from ``step`` (a later call for the same step replaces it)."""
        self.changes = [c for c in self.changes if c[0] != step] + [[int(step), dict(weights)]]
        self.changes.sort(key=lambda c: c[0])

    def in_force(self, step: int) -> dict[str, float] | None:
        """The weights of the last change that applies to batch ``step`` (None: the config's)."""
        due = [c for c in self.changes if c[0] <= step]
        return dict(due[-1][1]) if due else None

    def due_at(self, step: int) -> bool:
        """Whether a change takes effect at batch ``step``."""
        return any(c[0] == step for c in self.changes)

    def build_for(self, step: int) -> Any:
        """The build function for batch ``step``: the original one, with the weights in force."""
        weights = self.in_force(step)
        return self.original if weights is None else with_weights(self.original, weights)

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
