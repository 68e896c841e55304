"""The per-dataset counting of an audit: a dataset's reader cursors and in-flight pieces ->
the documents and tokens it consumed per epoch (:class:`DatasetAudit`), and the rows of the
documents consumed.

:func:`~torchdata_ext.audit.report.audit_checkpoint` gathers each dataset's merged reader
state and :class:`Held` pieces from a checkpoint and calls :func:`audit_dataset`; what the
numbers mean exactly is in :mod:`torchdata_ext.audit.report`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from torchdata_ext.audit.render import HOLDERS
from torchdata_ext.order.shard_walk import walked_documents
from torchdata_ext.order.shards import file_offsets, shard_bounds
from torchdata_ext.order.split import EvalSplit, SplitFilter
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.state.reader_state import reader_cursors

__all__ = [
    "Cursors",
    "DatasetAudit",
    "EpochConsumption",
    "Held",
    "audit_dataset",
    "document_rows",
    "training_side",
]


@dataclass(frozen=True)
class EpochConsumption:
    """What a dataset consumed in one epoch.

    Attributes:
        epoch: the epoch number (0 is the first).
        documents: documents consumed in it.
        tokens: their tokens (a document cut by ``max_chunksize`` counts the tokens handed
            out); None when unknown (text data).
        percent_documents: ``documents`` over the dataset's documents, in percent.
        percent_tokens: ``tokens`` over the dataset's tokens, in percent (None if unknown).
    """

    epoch: int
    documents: int
    tokens: int | None
    percent_documents: float
    percent_tokens: float | None


@dataclass(frozen=True)
class DatasetAudit:
    """One dataset's part of an :class:`~torchdata_ext.audit.report.AuditReport`.

    Attributes:
        name: the dataset name.
        files: its number of files.
        documents: its documents (all files), without those held out for evaluation.
        held_out_documents: documents held out for evaluation (``eval_fraction``): the walk
            passes them, the training pipeline never delivers them; left out of every count.
        tokens: its tokens (counts files; held-out documents' excluded), None when unknown
            (text).
        logical_shards: its logical shard count.
        epoch_min: the lowest epoch a logical shard is in (the epoch its cursor reads next):
            the dataset's current epoch.
        epoch_max: the highest (a shard that finished epoch ``e`` is in ``e + 1``).
        shards_done: logical shards that finished ``epoch_min`` (now in a later epoch).
        epochs: consumption per epoch, from the current one to the last one any document
            was consumed in. The current epoch is ``epoch_min``, or the one before it when
            that one is complete and no shard has begun ``epoch_min`` yet (an epoch boundary,
            or a finished ``epochs=N`` run: 100%) or some of its documents are still in
            flight.
        in_flight_documents: consumed documents with tokens not yet delivered.
        in_flight_tokens: tokens in flight (None when unknown).
        in_flight_by_holder: in-flight documents by where they are held: ``pipeline``
            (tokenize / interleave / pack), ``shuffle_buffer``, ``handed_back`` (by a rescale);
            a document held in two places counts in both.
        skipped_documents: documents skipped by ``on_error="skip"`` (all epochs).
        weight: its target weight (None without a mix).
        target_share: the weight over the sum of the weights.
        tokens_delivered: the tokens of the documents consumed in every epoch so far less
            those in flight: what the trainer received (plus what the pipeline dropped: see
            the module docstring), from the same cut as the other counts; None when tokens are
            unknown (text).
        token_share: ``tokens_delivered`` over all datasets' (None if nothing delivered yet).
        documents_delivered: the documents consumed in every epoch so far less those in
            flight and those skipped by ``skip_steps``: all of whose tokens the trainer
            received (or dropped).
        step_skipped_documents: documents with pieces in the batches of steps skipped by
            ``PipelineConfig.skip_steps`` (never delivered later in that epoch: their readers
            passed them), once per epoch they were skipped in.
        step_skipped_tokens: the tokens of those pieces (not in ``tokens_delivered``).
    """

    name: str
    files: int
    documents: int
    held_out_documents: int
    tokens: int | None
    logical_shards: int
    epoch_min: int
    epoch_max: int
    shards_done: int
    epochs: list[EpochConsumption]
    in_flight_documents: int
    in_flight_tokens: int | None
    in_flight_by_holder: dict[str, int]
    skipped_documents: int
    weight: float | None
    target_share: float | None
    tokens_delivered: int | None
    token_share: float | None
    documents_delivered: int | None = None
    step_skipped_documents: int = 0
    step_skipped_tokens: int = 0

    @property
    def current(self) -> EpochConsumption:
        """The consumption of the current epoch: ``epochs[0]`` (see ``epochs``)."""
        return self.epochs[0]


@dataclass(frozen=True)
class Cursors:
    """A dataset's live cursors and in-flight pieces, kept to list documents on demand."""

    index: DatasetIndex
    n_logical_shards: int
    seed: int
    shard: np.ndarray
    epoch: np.ndarray
    pos: np.ndarray
    offset: np.ndarray
    in_flight: np.ndarray  # global document ids with a piece in flight, unique
    kept: np.ndarray | None  # per global document: on the training side (None: all are)
    first: int  # the first epoch listed (_first_epoch)


class Held:
    """One dataset's pieces in flight, by holder, reduced as each worker's are read: the
    documents holding them (global ids) and their tokens (None when lengths are unknown)."""

    def __init__(self, index: DatasetIndex, lengths: np.ndarray | None) -> None:
        self._offsets = file_offsets(index.doc_counts)
        self._lengths = lengths
        self._ids: dict[str, list[np.ndarray]] = {h: [] for h in HOLDERS}
        self.tokens: int | None = None if lengths is None else 0

    def add(self, holder: str, pieces: Any) -> None:
        """Pieces ``(file, doc, start, stop)`` (stop -1: to the document's end) held by
        ``holder``."""
        arr = np.asarray(pieces, np.int64).reshape(-1, 4)
        ids = self._offsets[arr[:, 0]] + arr[:, 1]
        self._ids[holder].append(np.unique(ids))
        if self._lengths is not None and self.tokens is not None:
            stop = np.where(arr[:, 3] < 0, self._lengths[ids], arr[:, 3])
            self.tokens += int((stop - arr[:, 2]).sum())

    def documents(self, holder: str | None = None) -> np.ndarray:
        """The documents holding pieces (of ``holder``, or of any), unique."""
        parts = self._ids[holder] if holder else [a for h in HOLDERS for a in self._ids[h]]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def training_side(index: DatasetIndex, split: EvalSplit | None) -> np.ndarray | None:
    """Per document of ``index`` (files in order): whether the training pipeline delivers it
    (not held out by ``split``, decided as the reader decides: :class:`SplitFilter`); None
    without a split."""
    if split is None:
        return None
    keep = SplitFilter(split, "train", index.name, index.files)
    offsets = file_offsets(index.doc_counts)
    out = np.ones(int(offsets[-1]), bool)
    for f, n in enumerate(index.doc_counts.tolist()):
        out[offsets[f] : offsets[f + 1]] = keep.keep(f, np.arange(n))
    return out


def audit_dataset(
    index: DatasetIndex,
    merged: dict[str, Any],
    held: Held,
    lengths: np.ndarray | None,
    kept: np.ndarray | None,
    *,
    weight: float | None,
    target_share: float | None,
) -> tuple[Cursors, DatasetAudit]:
    """Count one dataset from its workers' reader states ``merged``, the pieces ``held`` in
    flight, its documents' ``lengths`` (None: tokens unknown) and ``kept`` (per document: on
    the training side; None: all). Returns its cursors (to list documents) and its audit
    (``token_share`` None: the caller sets it over all datasets)."""
    n = int(merged["n_logical_shards"])
    view = reader_cursors(merged)
    shard, epoch, pos, offset = view.ids, view.epoch, view.pos, view.offset
    skips = int(view.skips.sum())
    offsets = file_offsets(index.doc_counts)
    bounds = shard_bounds(int(offsets[-1]), n)
    size = bounds[shard + 1] - bounds[shard]
    # the documents each cursor has passed in its own epoch (one more: a document begun)
    entry, file, doc = walked_documents(
        offsets, n, int(merged["seed"]), shard, epoch, pos + (offset > 0)
    )
    walked = offsets[file] + doc
    doc_tokens = shard_tokens = total_tokens = None
    if lengths is not None:
        doc_tokens, shard_tokens, total_tokens = _token_counts(
            lengths, kept, walked, entry, offset, bounds[shard], bounds[shard + 1]
        )
    if kept is not None:  # held-out documents are passed by the walk, never delivered
        ck = np.concatenate([[0], np.cumsum(kept)])
        size = ck[bounds[shard + 1]] - ck[bounds[shard]]
        mine = kept[walked]
        entry, walked = entry[mine], walked[mine]
        if doc_tokens is not None:
            doc_tokens = doc_tokens[mine]
    walked_docs = np.bincount(entry, minlength=len(shard))
    total_docs = int(offsets[-1]) if kept is None else int(kept.sum())
    in_flight = held.documents()
    first = _first_epoch(epoch, pos, offset, walked, in_flight)
    epochs = _epochs_consumed(
        first, epoch, size, walked_docs, total_docs, entry, doc_tokens, shard_tokens, total_tokens
    )
    by_holder = {h: len(held.documents(h)) for h in HOLDERS}
    # every epoch so far: a shard in epoch e has passed all of epochs 0 .. e - 1 whole
    documents_all = int((epoch * size).sum() + walked_docs.sum())
    tokens_delivered = None
    if doc_tokens is not None and held.tokens is not None:
        tokens_delivered = int((epoch * shard_tokens).sum() + doc_tokens.sum()) - held.tokens
    cursors = Cursors(
        index, n, int(merged["seed"]), shard, epoch, pos, offset, in_flight, kept, first
    )
    audit = DatasetAudit(
        name=index.name,
        files=len(index.files),
        documents=total_docs,
        held_out_documents=int(offsets[-1]) - total_docs,
        tokens=total_tokens if kept is not None or index.total_tokens < 0 else index.total_tokens,
        logical_shards=n,
        epoch_min=int(epoch.min()),
        epoch_max=int(epoch.max()),
        shards_done=int((epoch > epoch.min()).sum()),
        epochs=epochs,
        in_flight_documents=len(in_flight),
        in_flight_tokens=held.tokens,
        in_flight_by_holder=by_holder,
        skipped_documents=skips,
        weight=weight,
        target_share=target_share,
        tokens_delivered=tokens_delivered,
        token_share=None,  # set by audit_checkpoint, over all datasets
        documents_delivered=documents_all - len(in_flight),
    )
    return cursors, audit


def _token_counts(
    lengths: np.ndarray,
    kept: np.ndarray | None,
    walked: np.ndarray,
    entry: np.ndarray,
    offset: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Tokens of each ``walked`` document (of a document begun, by the cursor ``entry`` walks
    it with, its ``offset``: the part handed out), of each cursor's shard ``[lo, hi)`` and of
    the dataset; held-out documents (not ``kept``) count in neither of the last two."""
    doc_tokens = lengths[walked].copy()
    begun = np.flatnonzero(offset > 0)  # the last walked document of these: in part
    last = np.cumsum(np.bincount(entry, minlength=len(offset))) - 1
    doc_tokens[last[begun]] = offset[begun]
    if kept is not None:
        lengths = np.where(kept, lengths, 0)
    cum = np.concatenate([[0], np.cumsum(lengths)])
    return doc_tokens, cum[hi] - cum[lo], int(lengths.sum())


def _epochs_consumed(
    first: int,
    epoch: np.ndarray,
    size: np.ndarray,
    walked_docs: np.ndarray,
    total_docs: int,
    entry: np.ndarray,
    doc_tokens: np.ndarray | None,
    shard_tokens: np.ndarray | None,
    total_tokens: int | None,
) -> list[EpochConsumption]:
    """The documents (and tokens) consumed in each epoch from ``first`` on, per cursor: a
    shard past epoch ``e`` consumed all of its ``size`` documents (``shard_tokens``) in it, a
    shard in ``e`` its ``walked_docs`` (the ``doc_tokens`` of the walked documents, by
    ``entry``). Stops at the first epoch after ``first`` with nothing consumed yet."""
    epochs: list[EpochConsumption] = []
    for e in range(first, int(epoch.max()) + 1):
        docs = int(size[epoch > e].sum() + walked_docs[epoch == e].sum())
        if epochs and not docs:
            break  # shards that finished an epoch wait at the next one, not begun
        tok = None
        if doc_tokens is not None and shard_tokens is not None:
            tok = int(shard_tokens[epoch > e].sum() + doc_tokens[epoch[entry] == e].sum())
        epochs.append(
            EpochConsumption(
                e,
                docs,
                tok,
                100.0 * docs / total_docs,
                None if tok is None or not total_tokens else 100.0 * tok / total_tokens,
            )
        )
    return epochs


def _first_epoch(
    epoch: np.ndarray,
    pos: np.ndarray,
    offset: np.ndarray,
    walked: np.ndarray,
    in_flight: np.ndarray,
) -> int:
    """The first epoch to list: the lowest a shard is in, or the one before it when that one
    is complete (every shard is past it) and either no shard has begun the next (a finished
    run, or an epoch boundary) or documents of it are still in flight (not consumed since)."""
    low = int(epoch.min())
    if low == 0:
        return 0
    at_low = epoch == low
    if not ((pos > 0) | (offset > 0))[at_low].any():
        return low - 1
    if len(in_flight) and not np.isin(in_flight, walked).all():
        return low - 1
    return low


def document_rows(c: Cursors) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(file, doc, epoch, in_flight)`` of every document ``c`` consumed, sorted by epoch,
    file and document."""
    offsets = file_offsets(c.index.doc_counts)
    bounds = shard_bounds(int(offsets[-1]), c.n_logical_shards)
    lo, hi = bounds[c.shard], bounds[c.shard + 1]
    entry, file, doc = walked_documents(
        offsets, c.n_logical_shards, c.seed, c.shard, c.epoch, c.pos + (c.offset > 0)
    )
    ids = [offsets[file] + doc]
    eps = [c.epoch[entry]]
    for e in range(c.first, int(c.epoch.max())):
        done = np.flatnonzero(c.epoch > e)  # whole shards consumed in epoch e
        n = hi[done] - lo[done]
        first = np.cumsum(n) - n
        ids.append(np.repeat(lo[done] - first, n) + np.arange(int(n.sum()), dtype=np.int64))
        eps.append(np.full(int(n.sum()), e, np.int64))
    g = np.concatenate(ids)
    epoch = np.concatenate(eps)
    if c.kept is not None:  # held-out documents are never delivered: no row
        mine = c.kept[g]
        g, epoch = g[mine], epoch[mine]
    latest = np.full(int(offsets[-1]), -1, np.int64)
    np.maximum.at(latest, g, epoch)
    flight = np.zeros(len(g), bool)
    if len(c.in_flight):
        flight = np.isin(g, c.in_flight) & (epoch == latest[g])
    order = np.lexsort((g, epoch))
    g, epoch, flight = g[order], epoch[order], flight[order]
    f = np.searchsorted(offsets, g, side="right") - 1
    return f, g - offsets[f], epoch, flight
