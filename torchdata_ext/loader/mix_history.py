"""The tokens a rank delivered per dataset at each weight change: the per-segment history a
single checkpoint carries (issue 31), for the audit's table of achieved vs target shares.

Each worker's ``Collate`` counts the document tokens it delivered per dataset in its state
(``"delivered"``, see :class:`~torchdata_ext.nodes.collate.Collate`), and the loader holds each
worker's exact state at every step, so the rank's tokens delivered through a step are a
``base`` plus the sum of its workers' counts. When the workers restart for a weight change at
step ``S`` (built with the new weights from the exact state after ``S - 1``), the loader
records the totals through ``S - 1`` with ``S``. The loader state (and each rank's entry of a
checkpoint) carries it as ``"mix_history"``::

    {"since": 0, "base": {name: tokens}, "changes": [[S, {name: tokens through S - 1}], ...],
     "through": step, "delivered": {name: tokens through step}}

``since``: the step from which the counts are known (0: the whole run; a restore from a state
saved before the counts existed starts them at its step: what came before is unknown, never
guessed). ``delivered`` is None when a worker's graph has no count (a pipeline not ending in
``Collate``). A restore on the same topology goes on with the saved ``base`` (the workers'
counts are restored); a rescale starts fresh workers (counts at 0), and new rank ``r`` carries
old ranks ``r, r + R', r + 2R', ...`` (``R'`` new ranks): their ``delivered`` summed as its
``base``, their changes summed per step, so summing over ranks still gives the run's figure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["DELIVERED_KEY", "MixHistory", "graph_totals"]

SOURCE_KEY = "source"  # where a node wrapping another keeps its state (torchdata's)
DELIVERED_KEY = "delivered"
"""The key of a worker graph's root state (``Collate``) that counts its tokens per dataset."""


def _add(a: Mapping[str, int] | None, b: Mapping[str, int] | None) -> dict[str, int] | None:
    if a is None or b is None:
        return None
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + int(v)
    return out


def graph_totals(graphs: Iterable[Any]) -> dict[str, int] | None:
    """The tokens per dataset the worker graph states ``graphs`` (root states) counted,
    summed: each ``Collate``'s, at the root or under the ``"source"`` of nodes wrapping it
    (a build function that wraps the pipeline, as ``examples/train_tiny_lm.py`` does). A state without the key counts 0 (restored from a state saved before the counts
    existed, and no batch since); None when none has the key (a root other than
    ``Collate``) or a count stopped (None)."""
    total: dict[str, int] | None = {}
    seen = False
    for g in graphs:
        while isinstance(g, dict) and DELIVERED_KEY not in g:  # a root wrapping Collate
            g = g.get(SOURCE_KEY)
        if isinstance(g, dict):
            seen = True
            total = _add(total, g[DELIVERED_KEY])
    return total if seen else None


@dataclasses.dataclass
class MixHistory:
    """One rank's history of tokens delivered per dataset (module docstring).

    Attributes:
        since: the step from which the counts are known (0: the whole run).
        base: tokens per dataset delivered before the workers' counts started (a rescale).
        changes: ``[[S, {name: tokens through S - 1}], ...]``, one per weight change applied.
    """

    since: int = 0
    base: dict[str, int] = dataclasses.field(default_factory=dict)
    changes: list[list[Any]] = dataclasses.field(default_factory=list)

    def record(self, step: int, graphs: Iterable[Any]) -> None:
        """Record the totals through ``step - 1`` (workers' graph states ``graphs`` then) with
        the change at ``step`` (a later record of the same step replaces it)."""
        counted = graph_totals(graphs)
        if counted is None or step - 1 < self.since:
            return
        totals = _add(self.base, counted)
        self.changes = [c for c in self.changes if c[0] != step] + [[int(step), totals]]
        self.changes.sort(key=lambda c: c[0])

    def state(self, graphs: Iterable[Any], through: int) -> dict[str, Any]:
        """The history as the loader state records it, with the totals through step
        ``through`` of the workers' graph states ``graphs``."""
        return {
            "since": self.since,
            "base": dict(self.base),
            "changes": [[s, dict(t)] for s, t in self.changes],
            "through": int(through),
            "delivered": _add(self.base, graph_totals(graphs)),
        }

    @classmethod
    def restored(cls, saved: Mapping[str, Any] | None, step: int) -> MixHistory:
        """The history a same-topology restore at ``step`` goes on with (its workers' counts
        are restored with them); a state without one (saved before the counts existed): known
        from ``step`` on."""
        if not saved:
            return cls(since=int(step))
        return cls(
            since=int(saved["since"]),
            base={str(k): int(v) for k, v in saved["base"].items()},
            changes=[[int(s), dict(t)] for s, t in saved["changes"]],
        )

    @classmethod
    def rescaled(cls, saved: Iterable[Mapping[str, Any] | None], step: int) -> MixHistory:
        """The history of a new rank that carries the old ranks' histories ``saved`` at a
        rescale at ``step`` (its fresh workers count from 0): their totals summed as its
        base, their changes summed per step. One without a history (or without totals):
        known from ``step`` on."""
        saved = list(saved)
        if not saved:  # carries no old rank: delivered nothing before, all of it known
            return cls()
        if any(not h or h.get("delivered") is None for h in saved):
            return cls(since=int(step))
        base: dict[str, int] | None = {}
        by_step: dict[int, dict[str, int]] = {}
        for h in filter(None, saved):
            base = _add(base, h["delivered"])
            for s, t in h["changes"]:
                by_step[int(s)] = _add(by_step.get(int(s), {}), t) or {}
        return cls(
            since=max(int(h["since"]) for h in saved if h),
            base=base or {},
            changes=[[s, by_step[s]] for s in sorted(by_step)],
        )
