"""Achieved vs target token shares per segment of the weight changes (a ``weight_schedule``
and the trainer's ``set_weights`` calls, by step), and how far the delivered mix may lag a
change (issue 31 item 5).

A segment runs from one change's step to the step before the next one (the first from step
1, the last to the checkpoint's step); the changes are
:meth:`~torchdata_ext.loader.weights.WeightChanges.points` (a token-keyed schedule's points at
the steps the run's global batch put them, a ramp's stairs). Its tokens per dataset come from the history one
checkpoint carries (:mod:`torchdata_ext.loader.mix_history`): every rank's totals at each
change and at the save, summed over ranks. A history that does not reach back (a checkpoint
chain that started from a state saved before the counts existed) leaves the segments before
its first known step unknown: their shares are None, never guessed.

The lag: when a change lands at step ``S`` the workers restart from the exact state after
``S - 1`` (nothing prefetched is kept), but each logical worker (ranks x workers) still holds
rows mixed at the old weights: its shuffle buffer (``shuffle_buffer`` rows, when > 1), the
packer's open row, and the interleave's current run (``mix_quantum_tokens``; when documents
are never cut at row ends, also the longest document). :func:`lag_tokens` is their sum in
tokens, an upper bound on the old mix's tokens delivered after ``S``; ``lag_steps`` the same
in steps (global tokens a step: ranks x ``batch_size`` x ``seq_length``). The shuffle buffer
draws its rows at random, so a few old rows may come later than that many steps, but never
more tokens in all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from torchdata_ext.audit.mix_note import mix_bound_tokens
from torchdata_ext.loader.weights import WeightChanges
from torchdata_ext.pipeline.build import mix_cuts_rows, mix_quantum_tokens
from torchdata_ext.pipeline.config import PipelineConfig

__all__ = ["MixSegments", "SegmentShares", "lag_tokens", "mix_segments", "run_targets"]


@dataclass(frozen=True)
class SegmentShares:
    """One segment of the run under one set of weights.

    Attributes:
        start: its first step (1-based, as ``TokenLoader.state_dict()['step']``).
        stop: its last step (the step before the next change, or the checkpoint's step).
        source: what set its weights: ``"config"`` (the config's ``weights``), ``"schedule"``
            (its ``weight_schedule``, a ramp's stair too) or ``"trainer"`` (``set_weights``).
        target: per dataset, its weight over the sum of the weights in force.
        achieved: per dataset, its share of the document tokens delivered in the segment
            (None: not known, see the module docstring).
        tokens: per dataset, the document tokens delivered in the segment (None: not known).
    """

    start: int
    stop: int
    source: str
    target: dict[str, float]
    achieved: dict[str, float] | None
    tokens: dict[str, int] | None

    @property
    def total(self) -> int | None:
        """All datasets' tokens in the segment (None: not known)."""
        return None if self.tokens is None else sum(self.tokens.values())

    @property
    def off_tokens(self) -> int | None:
        """The largest gap between a dataset's tokens and its target share of the segment's
        tokens, in tokens (None: not known)."""
        if self.tokens is None:
            return None
        total = sum(self.tokens.values())
        return max(round(abs(n - self.target.get(k, 0.0) * total)) for k, n in self.tokens.items())


@dataclass(frozen=True)
class MixSegments:
    """The audit's per-segment table and the lag bound.

    Attributes:
        segments: one per set of weights in force, by step.
        known_from: the first step the per-segment history is known from (1: all of it).
        lag_tokens: at most this many tokens mixed at the old weights are delivered after a
            change (:func:`lag_tokens`, all ranks x workers).
        lag_steps: ``lag_tokens`` in steps (global tokens a step), rounded up.
        bound_tokens: how far (tokens) a segment's delivered tokens may be from its target
            shares: the mix's own bound (``mix_note``: quantum plus the longest document, or
            two rows with row cuts, per worker) plus the old mix carried in and the segment's
            own carried out (``2 * lag_tokens``); None when document lengths are unknown.
    """

    segments: list[SegmentShares]
    known_from: int
    lag_tokens: int
    lag_steps: int
    bound_tokens: int | None

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for the report's JSON."""
        return asdict(self)


def lag_tokens(cfg: PipelineConfig, logical_workers: int, longest: int | None) -> int:
    """Global tokens by which the delivered mix may lag a change of weights (module
    docstring): per logical worker the rows already mixed (``shuffle_buffer`` when > 1, plus
    the packer's open row, ``seq_length + shift`` tokens each) and the interleave's run
    (``mix_quantum_tokens``, plus the longest document ``longest`` when documents are not cut
    at row ends; None: unknown, counted as 0), times ``logical_workers`` (ranks x workers)."""
    row = cfg.seq_length + int(cfg.shift)
    rows = (cfg.shuffle_buffer if cfg.shuffle_buffer > 1 else 0) + 1
    run = mix_quantum_tokens(cfg) + (0 if mix_cuts_rows(cfg) else int(longest or 0))
    return logical_workers * (run + rows * row)


def _summed(totals: Sequence[Mapping[str, int]], names: Sequence[str]) -> dict[str, int]:
    return {n: sum(int(t.get(n, 0)) for t in totals) for n in names}


def mix_segments(
    manifest: Mapping[str, Any],
    rank_metas: Sequence[Mapping[str, Any]],
    cfg: PipelineConfig,
    lengths: Mapping[str, np.ndarray | None],
) -> MixSegments:
    """The per-segment table of a checkpoint with ``manifest`` and its ranks' entries
    ``rank_metas`` (rank order), for config ``cfg`` (its weights are the first segment's);
    ``lengths``: tokens per document of each dataset (None where unknown), for the bounds."""
    names = list(cfg.dataset_weights)
    step = int(manifest.get("step", 0))
    histories = [m.get("mix_history") for m in rank_metas]
    known = all(h and h.get("delivered") is not None for h in histories)
    since = max((int(h["since"]) for h in histories if h), default=step) if known else step
    points: list[tuple[int, Mapping[str, float], str]] = [(1, cfg.dataset_weights, "config")]
    # the trainer's and the schedule's changes by step (the trainer's last at a tie: it applies)
    for s, w, source in WeightChanges.of_state(manifest, None).points():
        if int(s) <= step:
            points = [p for p in points if p[0] != int(s)] + [(int(s), w, source)]
    points.sort(key=lambda p: p[0])

    def through(s: int) -> dict[str, int] | None:  # the run's totals through step s - 1
        if s == 1:
            return dict.fromkeys(names, 0) if since == 0 else None
        if not known or s - 1 < since:
            return None
        recorded = [dict(h["changes"]).get(s, {}) for h in histories if h]
        return _summed(recorded, names)

    end = _summed([h["delivered"] for h in histories if h], names) if known else None
    segments = []
    for k, (start, weights, source) in enumerate(points):
        last = points[k + 1][0] - 1 if k + 1 < len(points) else step
        a, b = through(start), (through(points[k + 1][0]) if k + 1 < len(points) else end)
        tokens = None if a is None or b is None else {n: b[n] - a[n] for n in names}
        total_w = sum(float(weights[n]) for n in names)
        all_tokens = sum(tokens.values()) if tokens else 0
        segments.append(
            SegmentShares(
                start=start,
                stop=last,
                source=source,
                target={n: float(weights[n]) / total_w for n in names},
                achieved=None
                if tokens is None
                else {n: (t / all_tokens if all_tokens else 0.0) for n, t in tokens.items()},
                tokens=tokens,
            )
        )
    known_lengths = [x for x in lengths.values() if x is not None and len(x)]
    longest = max((int(x.max()) for x in known_lengths), default=None)
    workers = int(manifest["world_size"]) * max(1, int(manifest["num_workers"]))
    lag = lag_tokens(cfg, workers, longest)
    per_step = int(manifest["world_size"]) * cfg.batch_size * cfg.seq_length
    mix = mix_bound_tokens(cfg, longest, workers)
    return MixSegments(
        segments=segments,
        known_from=since + 1 if since else 1,
        lag_tokens=lag,
        lag_steps=math.ceil(lag / per_step),
        bound_tokens=None if mix is None else mix + 2 * lag,
    )


def run_targets(mix: MixSegments) -> dict[str, float] | None:
    """The whole run's target share per dataset under its weight changes: each segment's
    target weighted by the segment's tokens (what the run's achieved share compares with).
    None with one segment (the weights' own shares hold) or a segment not known."""
    segs = mix.segments
    if len(segs) < 2 or any(s.tokens is None for s in segs):
        return None
    total = sum(s.total or 0 for s in segs)
    if not total:
        return None
    names = list(segs[0].target)
    return {n: sum((s.total or 0) * s.target[n] for s in segs) / total for n in names}
