"""Why a dataset's token share is off its target: one line for the audit's table.

In ``interleave_mode: tokens`` each worker may run ``mix_quantum_tokens`` plus two rows past a
dataset's share when the mix switches datasets at row ends inside documents (``pack_mode:
concat``, no run budget, no phases), else ``mix_quantum_tokens`` plus its longest document
(documents are then never split between datasets); the audit says so, with the bound in
tokens, when a share is :data:`FAR_OFF` or more from its target, and names what else moves
shares when the gap is larger than that (``docs/pipeline.md``, "How close the mix is").
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from torchdata_ext.audit.consumption import DatasetAudit
from torchdata_ext.pipeline.build import mix_cuts_rows, mix_quantum_tokens
from torchdata_ext.pipeline.config import PipelineConfig

__all__ = ["FAR_OFF", "mix_bound_tokens", "mix_note"]


FAR_OFF = 0.05
"""How far (share of all tokens) a dataset's token share may be from its target before the
audit says why (:func:`mix_note`)."""


def mix_bound_tokens(cfg: PipelineConfig, longest: int | None, workers: int) -> int | None:
    """How many tokens (all ``workers``: ranks x workers) the mix may run past a dataset's
    share: per worker ``mix_quantum_tokens`` plus two rows when it switches datasets at row
    ends, else plus the longest document ``longest`` (None: unknown, then None)."""
    quantum = mix_quantum_tokens(cfg)
    if mix_cuts_rows(cfg):
        return workers * (quantum + 2 * (cfg.seq_length + int(cfg.shift)))
    return None if longest is None else workers * (quantum + longest)


def mix_note(
    cfg: PipelineConfig,
    audits: list[DatasetAudit],
    lengths: Mapping[str, np.ndarray | None],
    workers: int,
) -> str | None:
    """One line on the dataset whose token share is furthest off its target, when that is
    :data:`FAR_OFF` or more, saying why; None otherwise.

    Args:
        cfg: the pipeline config (its ``interleave_mode`` and ``mix_quantum_tokens``).
        audits: the datasets' audits, token shares set.
        lengths: tokens per document of each dataset (None where unknown: text).
        workers: ranks x workers of the checkpoint (each mixes on its own).
    """
    gaps = {
        a.name: (a.token_share, a.target_share)
        for a in audits
        if a.token_share is not None and a.target_share is not None
    }
    if not gaps:
        return None
    name = max(gaps, key=lambda n: abs(gaps[n][0] - gaps[n][1]))
    share, target = gaps[name]
    gap = abs(share - target)
    if gap < FAR_OFF:
        return None
    total = sum(a.tokens_delivered or 0 for a in audits)
    head = (
        f"mix: {name} has {100 * share:.1f}% of the tokens delivered against its "
        f"{100 * target:.1f}% target"
    )
    if cfg.interleave_mode == "samples":
        return (
            f"{head}: interleave_mode 'samples' draws documents by weight, so token shares "
            "follow the datasets' document lengths; 'tokens' mixes by tokens (docs/pipeline.md)"
        )
    quantum = mix_quantum_tokens(cfg)
    if mix_cuts_rows(cfg):
        return _row_cut_note(head, cfg, quantum, workers, gap * total, total)
    known = [x for x in lengths.values() if x is not None and len(x)]
    longest = max((int(x.max()) for x in known), default=None)
    if longest is None:
        return (
            f"{head}: each of the {workers} worker(s) may run mix_quantum_tokens ({quantum:,}) "
            "+ its longest document (text: length unknown) past a share, as documents are never "
            "split between datasets; the gap closes as delivery goes on (docs/pipeline.md)"
        )
    bound = mix_bound_tokens(cfg, longest, workers)
    if bound is not None and gap * total <= bound:
        return (
            f"{head}: each of the {workers} worker(s) may run mix_quantum_tokens ({quantum:,}) "
            f"+ its longest document ({longest:,} tokens) past a share, as documents are never "
            f"split between datasets (up to {bound:,} tokens here, {total:,} delivered so far); "
            "the gap closes as delivery goes on (docs/pipeline.md)"
        )
    return (
        f"{head}, more than mix_quantum_tokens ({quantum:,}) and the longest document "
        f"({longest:,} tokens) explain: a dataset that ran out (epochs), a weight change or "
        "a budget (max_tokens) moves shares too (docs/pipeline.md)"
    )


def _row_cut_note(
    head: str, cfg: PipelineConfig, quantum: int, workers: int, off: float, total: int
) -> str:
    """The note when the mix switches datasets at row ends (``off``: the gap in tokens)."""
    rows = 2 * (cfg.seq_length + int(cfg.shift))
    bound = mix_bound_tokens(cfg, None, workers)
    if bound is not None and off <= bound:
        return (
            f"{head}: each of the {workers} worker(s) may run mix_quantum_tokens ({quantum:,}) "
            f"+ two rows ({rows:,} tokens) past a share, as it switches datasets at row ends "
            f"(up to {bound:,} tokens here, {total:,} delivered so far); the gap closes as "
            "delivery goes on (docs/pipeline.md)"
        )
    return (
        f"{head}, more than mix_quantum_tokens ({quantum:,}) and two rows ({rows:,} tokens) "
        "per worker explain: the shuffle buffer's draws, a dataset that ran out (epochs), a "
        "weight change, or a checkpoint from before row cuts (documents whole) move shares "
        "too (docs/pipeline.md)"
    )
