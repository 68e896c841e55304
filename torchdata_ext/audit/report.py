"""What a checkpoint says the run consumed: per dataset, per epoch, which documents.

:func:`audit_checkpoint` reads a checkpoint folder (:mod:`torchdata_ext.checkpoint.folder`) and the
pipeline config, and answers from the reader cursors, the counts files and the provenance in
the states, without reading documents:

* per dataset, the epochs its logical shards are in (min / max), and for each epoch from the
  lowest on the documents and tokens consumed out of the dataset's total (exact);
* the documents **in flight**: pieces held by tokenize / interleave / pack, the pieces of the
  sequences in the shuffle buffer, and pieces a rescale handed back to a shard (``returned``);
* the documents and tokens **delivered**, and each dataset's share of the tokens delivered
  against its target weight;
* :meth:`AuditReport.documents`: one row per document consumed, to prove a document was or
  was not seen.

Definitions (what the numbers mean exactly):

* A document is **consumed** in epoch ``e`` once it has left its reader in that epoch: its
  logical shard's walk (:mod:`torchdata_ext.order.shard_walk`) has passed it, or the reader has
  handed out the first piece of it (a document cut by ``max_chunksize``). Documents the walk
  passed and dropped (shorter than ``min_length``, skipped by ``on_error="skip"``: counted
  in ``skipped``, or dropped by a filter transform) count as consumed: the epoch will not
  return to them, and they are never delivered.
* A consumed document is **in flight** while some of its tokens have not been delivered to
  the trainer: held by a node between the reader and the batch (tokenize, interleave, pack),
  sitting in the shuffle buffer, or handed back by a rescale and not yet read again. So the
  documents consumed and not in flight are exactly the documents all of whose tokens were
  delivered in batches up to the checkpoint, and those dropped as above
  (``tests/test_audit.py`` and ``tests/test_kill.py`` check this against the provenance of
  the delivered batches, between two checkpoints of one run).
* A piece in flight is attributed to the latest epoch in which its document was consumed.
* **Delivered** (``documents_delivered``, ``tokens_delivered``, the token share) is consumed
  less in flight, over every epoch so far (a logical shard in epoch ``e`` passed epochs
  ``0 .. e - 1`` whole): the documents all of whose tokens reached the trainer and the tokens
  that did, plus those dropped as above (and a budget's cut tail), counted from the same cut
  as the other numbers, so ``delivered = consumed - in flight`` holds at every checkpoint,
  right after a restore too (a restore delivers nothing: its audit equals the audit of the
  checkpoint it restored). Tokens unknown (text): None.
* A block the pack had pulled but used nothing of when the state was taken (a state just
  restored or rescaled, or one taken right at a block's start) is not in the checkpoint: a
  restore reads it again, and the audit does not count its documents as consumed.
* Documents held out for evaluation (``eval_fraction``, :mod:`torchdata_ext.order.split`) are
  passed by the training readers' walk and never delivered: they are left out of every count,
  total and row (``DatasetAudit.held_out_documents`` says how many).
* Transforms that change a document's tokens (``truncate``...) do not change what is
  consumed; "all of its tokens delivered" then means all that the transform kept.
* Tokens are the tokens stored in the files (as the counts files count them, before
  ``strip_tokens``; the BOS/EOS the packer adds are not counted); they need each file's
  document lengths from its metadata (Arrow footer, ``.npy`` header, offsets index: read once,
  no document is read). For text files (tokenized on the fly) tokens are unknown (None).

Where the checkpoint lags: the reader state a checkpoint records is a replay point (the
nodes above re-read their current block on restore and drop what they had used, see
``docs/DESIGN.md``), so the readers' live cursors are not in it. With ``replay=True``
(default) the audit restores, per worker, only the pack node and what feeds it (never the
shuffle buffer, whose contents are known from provenance; the nodes under the pack alone when
the pack holds nothing) and takes the same consistent cut a rescale takes
(:func:`torchdata_ext.checkpoint.rescale.live_cut`): this reads the few blocks those nodes were working
on (at most a few blocks per dataset per worker). ``replay=False``
reads nothing but the checkpoint and the counts: documents are then counted up to the
recorded replay points, and what tokenize / interleave / pack hold is not known
(``AuditReport.replayed`` is False and the report says so).

At ~580 lines this module is over the style's ~500: the report types and the counting that
fills them (cursors -> documents and tokens per epoch, in-flight pieces -> documents) are one
piece; the table and the picture are in ``render.py``.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa

from torchdata_ext.audit import render as _audit_render
from torchdata_ext.audit.render import HOLDERS
from torchdata_ext.checkpoint.folder import read_manifest, read_worker_states
from torchdata_ext.checkpoint.rescale import live_cut
from torchdata_ext.checkpoint.restore import dataset_differs
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.nodes.shuffle import buffered_provenance
from torchdata_ext.order.shard_walk import walked_documents
from torchdata_ext.order.shards import file_offsets, shard_bounds
from torchdata_ext.order.split import EvalSplit, SplitFilter
from torchdata_ext.pipeline.build import PipelineConfig, build_datasets, build_pipeline
from torchdata_ext.remote import write_bytes_atomic
from torchdata_ext.sources.fingerprint import check_data_files, compared
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.state.graph import (
    graph_nodes,
    pack_states,
    reader_states,
    shuffle_states,
)
from torchdata_ext.state.reader_state import merge_reader_states, reader_cursors
from torchdata_ext.world import World

__all__ = ["AuditReport", "DatasetAudit", "EpochConsumption", "audit_checkpoint"]


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
    """One dataset's part of an :class:`AuditReport`.

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
            flight: all of whose tokens the trainer received (or dropped).
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

    @property
    def current(self) -> EpochConsumption:
        """The consumption of the current epoch: ``epochs[0]`` (see ``epochs``)."""
        return self.epochs[0]


@dataclass(frozen=True)
class _Cursors:
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


class _Held:
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


@dataclass(frozen=True)
class AuditReport:
    """What a checkpoint says the run consumed (see :mod:`torchdata_ext.audit.report`).

    Attributes:
        checkpoint: the checkpoint folder's URL.
        world_size: ranks when the checkpoint was taken.
        num_workers: dataloader workers per rank then.
        seed: the pipeline seed.
        datasets: one :class:`DatasetAudit` per dataset, in the config's order.
        replayed: whether the pieces held by tokenize / interleave / pack were found by
            replaying their current blocks (False: counted up to the recorded replay points
            and those pieces unknown).
        lagging_batches: batches delivered after the workers' last state snapshot
            (``snapshot_every_n_steps > 1``), summed over ranks: the audit describes the run
            that many batches earlier.
        changed_files: data files that changed since the checkpoint was taken, each
            ``dataset/file: what differs``; an empty list: verified, nothing changed; None: not
            checked (``verify=False``).
        verified: with ``verify``, what was compared (how many files, which parts of each);
            None without.
    """

    checkpoint: str
    world_size: int
    num_workers: int
    seed: int
    datasets: list[DatasetAudit]
    replayed: bool
    lagging_batches: int
    changed_files: list[str] | None = None
    verified: str | None = None
    _cursors: dict[str, _Cursors] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (what :meth:`to_json` writes)."""
        out = asdict(self)
        del out["_cursors"]
        return out

    def to_json(self, indent: int | None = 1) -> str:
        """The report as JSON text (:meth:`to_dict`), for scripts."""
        return json.dumps(self.to_dict(), indent=indent)

    def documents(self) -> pa.Table:
        """One row per document consumed, per epoch from each dataset's ``epoch_min`` on.

        Columns: ``dataset`` and ``file`` (URL; dictionary-encoded strings), ``file_index``
        (the file's number in the dataset's sorted file list), ``doc`` (the document's index
        in its file), ``epoch``, ``in_flight`` (some of its tokens not yet delivered; on the
        row of the latest epoch that consumed it). Rows are sorted by dataset (config order),
        epoch, file and document. Computed from the cursors on each call (vectorised).
        """
        parts = [_document_rows(c) for c in self._cursors.values()]
        names = list(self._cursors)
        ds = np.concatenate([np.full(len(p[0]), i, np.int32) for i, p in enumerate(parts)])
        urls: list[str] = []
        file_ids = []
        for (file, _, _, _), c in zip(parts, self._cursors.values()):
            file_ids.append(file.astype(np.int64) + len(urls))
            urls.extend(c.index.files)
        cols = [np.concatenate([p[k] for p in parts]) for k in range(4)]
        return pa.table(
            {
                "dataset": pa.DictionaryArray.from_arrays(ds, pa.array(names, pa.string())),
                "file": pa.DictionaryArray.from_arrays(
                    np.concatenate(file_ids).astype(np.int32), pa.array(urls, pa.string())
                ),
                "file_index": pa.array(cols[0].astype(np.int32)),
                "doc": pa.array(cols[1].astype(np.int64)),
                "epoch": pa.array(cols[2].astype(np.int32)),
                "in_flight": pa.array(cols[3].astype(bool)),
            }
        )

    def write_documents(self, url: str, storage_options: dict[str, Any] | None = None) -> int:
        """Write :meth:`documents` to a Parquet file (any fsspec URL, written atomically).

        Args:
            url: the file to write (e.g. ``consumed.parquet``).
            storage_options: fsspec options for ``url``.

        Returns:
            The number of rows written.
        """
        import pyarrow.parquet as pq

        table = self.documents()
        buf = io.BytesIO()
        pq.write_table(table, buf)
        write_bytes_atomic(url, buf.getvalue(), storage_options)
        return table.num_rows

    def format_table(self) -> str:
        """The report as a readable table (what ``torchdata-ext audit`` prints)."""
        return _audit_render.format_table(self)

    def plot(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        """Save a picture of the consumption per dataset: the share of the current epoch
        consumed (delivered, in flight), and each dataset's token share against its target.

        Args:
            url: the image file to write (any fsspec URL; its suffix picks the format:
                ``.png``, ``.svg``, ``.pdf``).
            storage_options: fsspec options for ``url``.

        Raises:
            ImportError: matplotlib is not installed (``pip install 'torchdata-ext[plot]'``).
        """
        _audit_render.plot(self, url, storage_options)


def audit_checkpoint(
    url: str,
    cfg: PipelineConfig | Mapping[str, Any] | str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    replay: bool = True,
    tokens: bool = True,
    verify: bool = False,
    allow_changed_files: bool = False,
) -> AuditReport:
    """Audit checkpoint folder ``url`` of a pipeline built from ``cfg``.

    Args:
        url: a checkpoint folder written by :func:`~torchdata_ext.checkpoint.folder.save_checkpoint`
            (any fsspec URL).
        cfg: the pipeline config the run used: a :class:`PipelineConfig`, a mapping of its
            fields, or the path of a YAML/JSON config file.
        storage_options: fsspec options for ``url`` (the data's are ``cfg.storage_options``).
        replay: find the pieces tokenize / interleave / pack hold by replaying the blocks they
            were working on (a few blocks per dataset per worker; see the module docstring);
            False reads only the checkpoint and the counts files.
        tokens: count tokens (reads each file's document lengths from its metadata once);
            False leaves token counts None.
        verify: re-check every data file against the fingerprint the checkpoint recorded
            (size, version, sha256 of its first and last 64 KiB: 128 KiB read per file, see
            :mod:`torchdata_ext.sources.fingerprint`); the report's ``changed_files`` lists what
            differs (an empty list: nothing changed).
        allow_changed_files: with ``verify``, report changed files instead of refusing (the
            counts then describe the files as they are now). Only files changed in place (same
            size and document counts) can be allowed: files added, removed or resized are
            always refused (as :func:`~torchdata_ext.checkpoint.folder.load_checkpoint` refuses them).

    Returns:
        The :class:`AuditReport`.

    Raises:
        FileNotFoundError: ``url`` holds no complete checkpoint.
        ValueError: the checkpoint does not belong to this config and data (another dataset,
            seed or logical shard count, files or counts changed), or a file of it is corrupt;
            with ``verify``: it records no fingerprints (saved by an earlier version);
            ``allow_changed_files`` without ``verify``.
        ChangedFilesError: with ``verify`` and not ``allow_changed_files``: data files changed
            since the checkpoint was saved (each named, with what differs).
    """
    if allow_changed_files and not verify:
        raise ValueError(
            "allow_changed_files=True needs verify=True: without verify no data file is "
            "re-checked, so there is nothing to allow; pass verify=True as well"
        )
    cfg = _as_config(cfg)
    manifest = read_manifest(url, storage_options)
    datasets = build_datasets(cfg, World())  # this process alone, never a collective
    _check_matches(url, manifest, cfg, datasets)
    changed: list[str] | None = None
    verified: str | None = None
    if verify:
        recorded = manifest.get("file_fingerprints")
        if recorded is None:
            raise ValueError(
                f"checkpoint {url} records no data file fingerprints (saved by an earlier "
                "version): it cannot be verified; audit it without verify"
            )
        changes = check_data_files(
            recorded, datasets, allow_changed_files=allow_changed_files, where=f"checkpoint {url}"
        )
        changed = [f"{n}/{c.file}: {', '.join(c.what)}" for n, cs in changes.items() for c in cs]
        verified = compared(recorded, datasets)
    live: dict[str, list[dict[str, Any]]] = {name: [] for name in datasets}
    lengths = {name: ix.doc_lengths() if tokens else None for name, ix in datasets.items()}
    held = {name: _Held(ix, lengths[name]) for name, ix in datasets.items()}
    lagging = 0
    counted_ranks: set[int] = set()
    for world, meta, graph in read_worker_states(url, storage_options):
        if world.rank not in counted_ranks:
            counted_ranks.add(world.rank)
            lagging += int(meta.get("skip_batches", 0))
        # the outermost pack and shuffle buffer; every mix (one per curriculum phase)
        pack_state = next(iter(pack_states(graph).values()), None)  # the outermost
        shuffle_state = next(iter(shuffle_states(graph).values()), None)
        names = list(pack_state["dataset_names"]) if pack_state else list(datasets)
        if shuffle_state is not None:
            _, rows = buffered_provenance(shuffle_state)
            rows = rows[(rows[:, 0] >= 0) & (rows[:, 4] > 0)]
            for i, name in enumerate(names):
                mine = rows[rows[:, 0] == i]
                stop = mine[:, 3] + mine[:, 4]
                held[name].add("shuffle_buffer", np.column_stack([mine[:, 1:4], stop]))
        if replay and pack_state is not None:
            root = build_pipeline(cfg, world, datasets, collate=False)
            pack = next(n for n in graph_nodes(root) if isinstance(n, Pack))
            if int(pack_state["consumed"]) or int(pack_state["bins"]):
                readers, cut, _ = live_cut(pack, pack_state)
            else:  # the pack holds nothing: its replay would only pull a block it never used
                readers, cut, _ = live_cut(pack.source, pack_state[Pack.SOURCE_KEY])
            for name in datasets:
                held[name].add("pipeline", [p[1:] for p in cut if p[0] == name])
        else:  # the outermost state of each reader (a curriculum's phases repeat it)
            readers = {}
            for st in reader_states({"graph": graph}).values():
                readers.setdefault(st["dataset"], st)
        for name, st in readers.items():
            live[name].append(st)
    weights = {name: manifest["datasets"][name].get("weight") for name in datasets}
    total_w = sum(w for w in weights.values() if w is not None)
    audits: list[DatasetAudit] = []
    cursors: dict[str, _Cursors] = {}
    for name, index in datasets.items():
        merged = merge_reader_states(live[name])
        back = [p for ex in reader_cursors(merged).extras.values() for p in ex.get("returned", [])]
        held[name].add("handed_back", back)
        w = weights[name]
        c, audit = _audit_dataset(
            index,
            merged,
            held[name],
            lengths[name],
            _training_side(index, cfg.eval_split(name)),
            weight=w,
            target_share=None if w is None or not total_w else w / total_w,
        )
        cursors[name] = c
        audits.append(audit)
    got = [a.tokens_delivered for a in audits]
    total = sum(t for t in got if t is not None)
    if total and None not in got:
        audits = [replace(a, token_share=(a.tokens_delivered or 0) / total) for a in audits]
    return AuditReport(
        checkpoint=url,
        world_size=int(manifest["world_size"]),
        num_workers=int(manifest["num_workers"]),
        seed=cfg.seed,
        datasets=audits,
        replayed=replay,
        lagging_batches=lagging,
        changed_files=changed,
        verified=verified,
        _cursors=cursors,
    )


# -- helpers -------------------------------------------------------------------------------------
def _as_config(cfg: Any) -> PipelineConfig:
    if isinstance(cfg, PipelineConfig):
        return cfg
    if isinstance(cfg, Mapping):
        return PipelineConfig.from_dict(cfg)
    if isinstance(cfg, (str, os.PathLike)):
        try:
            return PipelineConfig.from_file(os.fspath(cfg))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"cfg={os.fspath(cfg)!r} does not exist; pass the pipeline config (.yaml or "
                ".json) the run used"
            ) from None
    raise TypeError(
        f"cfg must be a PipelineConfig, a mapping of its fields or a YAML/JSON config path, "
        f"not {type(cfg).__name__}"
    )


def _check_matches(
    url: str, manifest: dict[str, Any], cfg: PipelineConfig, datasets: dict[str, DatasetIndex]
) -> None:
    """Refuse a checkpoint of other data: the audit would describe documents it never read."""
    saved = manifest["datasets"]
    if set(saved) != set(datasets):
        raise ValueError(
            f"checkpoint {url} has datasets {sorted(saved)} but the config has "
            f"{sorted(datasets)}; audit with the config the run used"
        )
    for name, index in datasets.items():
        s = saved[name]
        if s["fingerprint"] != index.fingerprint():  # the files named, as load_checkpoint does
            differs = dataset_differs(
                name, "fingerprint", s["fingerprint"], index.fingerprint(), manifest, index
            )
            raise ValueError(
                f"checkpoint {url} does not match the data now: {differs}; audit with the "
                "config and data the run used"
            )
        for key, mine, what in (
            ("seed", cfg.seed, "the config's seed differs"),
            ("n_logical_shards", cfg.logical_shards, "the config's logical_shards differs"),
        ):
            if s[key] != mine:
                raise ValueError(
                    f"checkpoint {url} does not match dataset {name!r}: {what} (checkpoint "
                    f"{key}={s[key]!r}, config/data {key}={mine!r}); audit with the config and "
                    "data the run used"
                )


def _training_side(index: DatasetIndex, split: EvalSplit | None) -> np.ndarray | None:
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


def _audit_dataset(
    index: DatasetIndex,
    merged: dict[str, Any],
    held: _Held,
    lengths: np.ndarray | None,
    kept: np.ndarray | None,
    *,
    weight: float | None,
    target_share: float | None,
) -> tuple[_Cursors, DatasetAudit]:
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
    doc_tokens = None
    if lengths is not None:
        doc_tokens = lengths[walked].copy()
        begun = np.flatnonzero(offset > 0)  # the last walked document of these: in part
        last = np.cumsum(np.bincount(entry, minlength=len(shard))) - 1
        doc_tokens[last[begun]] = offset[begun]
        if kept is not None:
            lengths = np.where(kept, lengths, 0)
        cum = np.concatenate([[0], np.cumsum(lengths)])
        shard_tokens = cum[bounds[shard + 1]] - cum[bounds[shard]]
    total_tokens = None if lengths is None else int(lengths.sum())
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
    epochs: list[EpochConsumption] = []
    for e in range(first, int(epoch.max()) + 1):
        docs = int(size[epoch > e].sum() + walked_docs[epoch == e].sum())
        if epochs and not docs:
            break  # shards that finished an epoch wait at the next one, not begun
        tok = None
        if doc_tokens is not None:
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
    by_holder = {h: len(held.documents(h)) for h in HOLDERS}
    # every epoch so far: a shard in epoch e has passed all of epochs 0 .. e - 1 whole
    documents_all = int((epoch * size).sum() + walked_docs.sum())
    tokens_delivered = None
    if doc_tokens is not None and held.tokens is not None:
        tokens_delivered = int((epoch * shard_tokens).sum() + doc_tokens.sum()) - held.tokens
    cursors = _Cursors(
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


def _document_rows(c: _Cursors) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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
