"""Config side of curriculum phases and budgets: ``PipelineConfig.phases`` / ``max_tokens`` /
``max_documents`` checked and normalised, and the ``Take`` a budget puts over a node.

The nodes are :class:`~torchdata_ext.nodes.concat.Concat` and
:class:`~torchdata_ext.nodes.take.Take`; :func:`torchdata_ext.pipeline.build.build_pipeline` places
them. Kept apart from :mod:`torchdata_ext.pipeline.build` so that module stays about the graph.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torchdata.nodes import BaseNode

from torchdata_ext.checks import check_int, split_list
from torchdata_ext.world import World

__all__ = ["BUDGET_KEYS", "check_budget", "check_phases", "with_budget"]

BUDGET_KEYS = ("max_tokens", "max_documents")
_PHASE_KEYS = frozenset({"datasets", "weights", *BUDGET_KEYS})


def check_budget(what: str, value: Any, datasets: Sequence[str]) -> int | dict[str, int] | None:
    """A ``max_tokens`` / ``max_documents`` config value checked: None, an int >= 0 (the whole
    run) or a mapping dataset -> int >= 0 (each a name in ``datasets``).

    Raises:
        ValueError: a negative budget, or a mapping naming a dataset not in ``datasets``.
        TypeError: not an integer.
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in datasets]
        if unknown:
            raise ValueError(
                f"{what} names {unknown}, which are not datasets ({list(datasets)}); give a "
                "dataset name or one int for the whole run"
            )
        return {str(k): check_int(f"{what}[{k!r}]", v, 0) for k, v in value.items()}
    return check_int(what, value, 0)


def check_phases(
    phases: Any, *, weights: Any, datasets: Any, epochs: int | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """``phases`` normalised to ``{"datasets": [...], "weights": [...], "max_tokens",
    "max_documents"}`` dicts, and the datasets of all phases in order.

    Args:
        phases: the config's phases (a list of mappings).
        weights: the config's top-level weights (must be empty with phases).
        datasets: the config's top-level datasets (empty, or the phases' datasets).
        epochs: the config's epochs (None: endless readers, so a phase needs a budget to end).

    Raises:
        ValueError: unknown keys, a phase without datasets, bad weights, a dataset in two
            phases, a non-last phase that never ends, top-level weights or datasets that
            disagree with the phases.
        TypeError: ``phases`` is not a list of mappings.
    """
    if isinstance(phases, (str, Mapping)) or not isinstance(phases, Sequence):
        raise TypeError(f"phases={phases!r} must be a list of mappings")
    if split_list(weights, "weights"):
        raise ValueError(
            f"weights={weights!r} with phases: give each phase its own weights "
            "(phases[i].weights) and leave weights empty"
        )
    out: list[dict[str, Any]] = []
    owner: dict[str, int] = {}
    for i, raw in enumerate(phases):
        if not isinstance(raw, Mapping):
            raise TypeError(f"phases[{i}]={raw!r} must be a mapping (datasets, weights, ...)")
        unknown = sorted(set(raw) - _PHASE_KEYS)
        if unknown:
            raise ValueError(
                f"phases[{i}] has unknown keys {unknown}; known: {sorted(_PHASE_KEYS)}"
            )
        names = split_list(raw.get("datasets"), f"phases[{i}].datasets")
        if not names:
            raise ValueError(f"phases[{i}] has no datasets; list the datasets it mixes")
        try:
            ws = [float(w) for w in split_list(raw.get("weights"), f"phases[{i}].weights")]
        except ValueError:
            raise ValueError(
                f"phases[{i}].weights={raw.get('weights')!r} must be numbers"
            ) from None
        if ws and (len(ws) != len(names) or any(not w > 0 for w in ws)):
            raise ValueError(f"phases[{i}].weights={ws} must be one number > 0 per dataset {names}")
        for name in names:
            if name in owner:
                raise ValueError(
                    f"dataset {name!r} is in phases[{owner[name]}] and phases[{i}]; a dataset "
                    "belongs to one phase (its epoch cursor is not shared)"
                )
            owner[name] = i
        phase: dict[str, Any] = {"datasets": names, "weights": ws or [1.0] * len(names)}
        for key in BUDGET_KEYS:
            v = raw.get(key)
            phase[key] = None if v is None else check_int(f"phases[{i}].{key}", v, 0)
        ends = phase["max_tokens"] is not None or phase["max_documents"] is not None
        if not ends and epochs is None and i < len(phases) - 1:
            raise ValueError(
                f"phases[{i}] never ends (no max_tokens/max_documents and epochs=None), so the "
                "later phases would never start; give it a budget or set epochs"
            )
        out.append(phase)
    declared = split_list(datasets, "datasets")
    if declared and set(declared) != set(owner):
        raise ValueError(
            f"datasets={declared} differs from the phases' datasets {list(owner)}; leave "
            "datasets empty with phases"
        )
    return out, declared or list(owner)


def with_budget(
    node: BaseNode, where: Any, dataset: str | None, name: str, world: World | None
) -> BaseNode:
    """``node`` under a ``Take`` if ``where`` (a config or a phase mapping) sets a budget: for
    ``dataset`` (an entry of a mapping budget), or for the whole run / phase (``dataset`` None:
    an int budget). Otherwise ``node`` itself: nothing is added to the graph.

    Args:
        node: the node to cap.
        where: a ``PipelineConfig`` or a normalised phase mapping.
        dataset: the dataset ``node`` reads, or None for a run / phase budget.
        name: the ``Take``'s name (unique in the graph).
        world: this copy's place (its share of the budget).
    """
    limits: list[int | None] = []
    for key in BUDGET_KEYS:
        v = where[key] if isinstance(where, Mapping) else getattr(where, key)
        if dataset is not None:
            v = v.get(dataset) if isinstance(v, Mapping) else None
        elif isinstance(v, Mapping):
            v = None
        limits.append(v)
    if limits == [None, None]:
        return node
    from torchdata_ext.nodes.take import Take

    return Take(node, max_tokens=limits[0], max_documents=limits[1], name=name, world=world)
