"""Rendering of an :class:`~torchdata_ext.audit.report.AuditReport`: the table and the picture.

Kept apart from :mod:`torchdata_ext.audit.report` (which counts) so each stays short; the report's
``format_table`` and ``plot`` call these.
"""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from torchdata_ext.remote import write_bytes_atomic

if TYPE_CHECKING:
    from torchdata_ext.audit.report import AuditReport
    from torchdata_ext.audit.segments import MixSegments

__all__ = ["HOLDERS", "format_segments", "format_table", "plot"]

# where a piece in flight is held (the keys of DatasetAudit.in_flight_by_holder)
HOLDERS = ("pipeline", "shuffle_buffer", "handed_back")


def format_table(report: AuditReport) -> str:
    """The report as a readable table (what ``torchdata-ext audit`` prints)."""
    how = (
        "pieces held by the pipeline found by replaying its current blocks"
        if report.replayed
        else "not replayed: counted to the recorded replay points, pieces held by "
        "tokenize/interleave/pack not known"
    )
    lines = [
        f"checkpoint {report.checkpoint}: {report.world_size} rank(s) x {report.num_workers} "
        f"worker(s), seed {report.seed} ({how})"
    ]
    if report.lagging_batches:
        lines.append(
            f"note: {report.lagging_batches} batches were delivered after the workers' last "
            "state snapshot; the audit describes the run before them"
        )
    head = (
        "dataset",
        "shard epochs",
        "epoch",
        "documents seen",
        "%",
        "tokens seen",
        "%",
        "in flight",
        "pipeline/buffer/back",
        "skipped",
        "token share",
        "target",
    )
    rows = [head]
    for d in report.datasets:
        for i, e in enumerate(d.epochs):
            first = i == 0
            by = d.in_flight_by_holder
            rows.append(
                (
                    d.name if first else "",
                    f"{d.epoch_min}-{d.epoch_max}" if first else "",
                    str(e.epoch),
                    f"{e.documents:,} / {d.documents:,}",
                    f"{e.percent_documents:.2f}",
                    "?" if e.tokens is None or d.tokens is None else f"{e.tokens:,} / {d.tokens:,}",
                    "?" if e.percent_tokens is None else f"{e.percent_tokens:.2f}",
                    f"{d.in_flight_documents:,}" if first else "",
                    "/".join(f"{by[h]:,}" for h in HOLDERS) if first else "",
                    f"{d.skipped_documents:,}" if first else "",
                    _pct(d.token_share) if first else "",
                    _pct(d.target_share) if first else "",
                )
            )
    widths = [max(len(r[k]) for r in rows) for k in range(len(head))]
    for r in rows:
        cells = [c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
    lines.append(
        "documents seen: consumed from the readers in that epoch; in flight: consumed, "
        "tokens not yet delivered (held by the pipeline / in the shuffle buffer / handed "
        "back by a rescale); token share: of the tokens delivered (consumed - in flight, all "
        "epochs), against the target weight"
    )
    step_skipped = [d for d in report.datasets if d.step_skipped_documents]
    if step_skipped:
        lines.append(
            "skipped by skip_steps (consumed, never delivered; --list: step_skipped): "
            + ", ".join(
                f"{d.name} {d.step_skipped_documents:,} documents ({d.step_skipped_tokens:,} "
                "tokens)"
                for d in step_skipped
            )
        )
    if report.mix_note:
        lines.append(report.mix_note)
    mix = report.mix_segments
    if mix is not None and (len(mix.segments) > 1 or mix.known_from > 1):
        lines.extend(format_segments(mix))
    if report.changed_files:
        lines.append(
            f"CHANGED data files since the checkpoint ({len(report.changed_files)}): "
            + "; ".join(report.changed_files)
        )
    elif report.changed_files is not None:
        lines.append("data files verified: no difference from the checkpoint's fingerprints")
    if report.verified is not None:
        lines.append(f"compared: {report.verified}")
    return "\n".join(lines)


def plot(report: AuditReport, url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Save a picture of the consumption per dataset: the share of the current epoch
    consumed (delivered, in flight), and each dataset's token share against its target.

    Args:
        url: the image file to write (any fsspec URL; its suffix picks the format:
            ``.png``, ``.svg``, ``.pdf``).
        storage_options: fsspec options for ``url``.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'torchdata-ext[plot]'``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "plotting the audit needs matplotlib: pip install 'torchdata-ext[plot]' "
            "(or pip install matplotlib)"
        ) from None
    fig = figure(report, Figure)
    buf = io.BytesIO()
    suffix = os.path.splitext(str(url))[1].lstrip(".").lower() or "png"
    try:
        fig.savefig(buf, format=suffix, dpi=100)
    except ValueError as exc:  # an unknown format
        raise ValueError(f"cannot save the audit plot as {url}: {exc}") from None
    write_bytes_atomic(str(url), buf.getvalue(), storage_options)


def figure(report: AuditReport, figure_class: Any) -> Any:
    """The audit picture (a matplotlib ``figure_class`` instance): per dataset, left, the share of
    the current epoch's documents consumed (delivered, then in flight) with the counts written
    at each bar; right, its share of the tokens delivered so far next to its target share, with
    the percentages (and the token count) written at each bar; with weight changes, a third
    panel: per segment of the changes, each dataset's target (dashed) and achieved share."""
    names = [d.name for d in report.datasets]
    y = np.arange(len(names))
    seen = np.array([d.current.percent_documents for d in report.datasets])
    flight = np.array([100 * d.in_flight_documents / max(d.documents, 1) for d in report.datasets])
    flight = np.minimum(flight, seen)
    mix = report.mix_segments
    segments = mix is not None and len(mix.segments) > 1
    width = 15 if segments else 10
    fig = figure_class(figsize=(width, 1.8 + 0.6 * len(names)), layout="constrained")
    axes = fig.subplots(1, 3 if segments else 2)
    ax1, ax2 = axes[0], axes[1]
    ax1.barh(y, seen - flight, color="#3b75af", label="delivered")
    ax1.barh(y, flight, left=seen - flight, color="#f0a030", label="in flight")
    for k, d in enumerate(report.datasets):
        held = min(d.in_flight_documents, d.current.documents)
        ax1.text(seen[k] + 1, k, f"{d.current.documents - held:,} + {held:,} of {d.documents:,}",
                 va="center", fontsize="small")  # fmt: skip
    ax1.set_xlim(0, 100)
    ax1.set_yticks(y, [f"{d.name} (epoch {d.current.epoch})" for d in report.datasets])
    ax1.invert_yaxis()
    ax1.set_xlabel("% of the current epoch's documents consumed (delivered + in flight)")
    below = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.3), "ncol": 2}
    ax1.legend(fontsize="small", frameon=False, **below)
    share = [100 * (d.token_share or 0.0) for d in report.datasets]
    target = [100 * (d.target_share or 0.0) for d in report.datasets]
    ax2.barh(y - 0.2, share, height=0.4, color="#3b75af", label="share of the tokens delivered")
    ax2.barh(y + 0.2, target, height=0.4, color="#9a9a9a", label="target share (weight)")
    for k, d in enumerate(report.datasets):
        tokens = "" if d.tokens_delivered is None else f" ({d.tokens_delivered:,} tokens)"
        ax2.text(share[k] + 1, k - 0.2, f"{_pct(d.token_share)}{tokens}", va="center",
                 fontsize="small")  # fmt: skip
        ax2.text(target[k] + 1, k + 0.2, _pct(d.target_share), va="center", fontsize="small")
    ax2.set_xlim(0, 100)
    ax2.set_yticks(y, names)
    ax2.invert_yaxis()
    ax2.set_xlabel("% of the tokens delivered so far (all datasets)")
    ax2.legend(fontsize="small", frameon=False, **below)
    if segments and mix is not None:
        _segments_axes(axes[2], mix, below)
    where = "/".join(report.checkpoint.rstrip("/").split("/")[-2:])
    fig.suptitle(f"audit of {where}", fontsize="medium")
    return fig


def format_segments(mix: MixSegments) -> list[str]:
    """The per-segment table's lines (what the audit's text prints)."""
    names = list(mix.segments[0].target) if mix.segments else []
    head = ["steps", "set by", *(f"{n} target/achieved" for n in names), "tokens", "off (tokens)"]
    rows = [head]
    for seg in mix.segments:
        cells = [f"{seg.start}-{seg.stop}", seg.source]
        for n in names:
            got = "?" if seg.achieved is None else f"{100 * seg.achieved[n]:.1f}%"
            cells.append(f"{100 * seg.target[n]:.1f}% / {got}")
        cells.append("?" if seg.total is None else f"{seg.total:,}")
        cells.append("?" if seg.off_tokens is None else f"{seg.off_tokens:,}")
        rows.append(cells)
    widths = [max(len(r[k]) for r in rows) for k in range(len(head))]
    lines = ["mix per segment of the weight changes (by step):"]
    for r in rows:
        cells = [c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))]
        lines.append("  " + "  ".join(cells).rstrip())
    if mix.known_from > 1:
        lines.append(
            f"per-segment history unknown before step {mix.known_from}: the run was restored "
            "from a state saved before the loader counted it (or behind its step); '?' marks "
            "what is not known"
        )
    bound = "" if mix.bound_tokens is None else f"; a segment's off <= {mix.bound_tokens:,}"
    lines.append(
        f"the mix may lag a change by up to {mix.lag_tokens:,} tokens (~{mix.lag_steps} "
        f"step(s)): rows mixed before it (shuffle buffer, open row, the mix's run) per "
        f"worker{bound} (the mix's bound plus the lag in and out; docs/pipeline.md)"
    )
    return lines


def _segments_axes(ax: Any, mix: MixSegments, below: dict[str, Any]) -> None:
    """Per segment of the weight changes (x), each dataset's target share (dashed) and
    achieved share (dots; none where not known), in %."""
    x = np.arange(len(mix.segments))
    for k, name in enumerate(mix.segments[0].target):
        color = f"C{k}"
        target = [100 * s.target[name] for s in mix.segments]
        got = [np.nan if s.achieved is None else 100 * s.achieved[name] for s in mix.segments]
        ax.plot(x, target, linestyle="--", drawstyle="steps-mid", color=color,
                label=f"{name} target")  # fmt: skip
        ax.plot(x, got, marker="o", linestyle="none", color=color, label=f"{name} achieved")
    ax.set_xticks(x, [f"{s.start}-{s.stop}" for s in mix.segments])
    ax.set_ylim(0, 100)
    ax.set_xlabel("segment of the weight changes (steps): % of its tokens")
    ax.legend(fontsize="small", frameon=False, **{**below, "ncol": 2})


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.2f}%"
