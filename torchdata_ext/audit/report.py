"""What a checkpoint says the run consumed: per dataset, per epoch, which documents.

:func:`audit_checkpoint` reads a checkpoint folder (:mod:`torchdata_ext.checkpoint.folder`), or the
loader state in a ``torch.distributed.checkpoint`` (:mod:`torchdata_ext.checkpoint.dcp_read`: the
same manifest and worker states), and the pipeline config, and answers from the reader cursors, the counts files and the provenance in
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
* **Skipped steps** (``PipelineConfig.skip_steps``): the pieces of the batches a restore
  skipped, which each rank's state lists, are consumed and never delivered: their documents
  (``step_skipped_documents``, unless still in flight for another piece) and tokens
  (``step_skipped_tokens``) leave the delivered counts.
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
(:func:`torchdata_ext.nodes.graph_cut.live_cut`): this reads the few blocks those nodes were working
on (at most a few blocks per dataset per worker). ``replay=False``
reads nothing but the checkpoint and the counts: documents are then counted up to the
recorded replay points, and what tokenize / interleave / pack hold is not known
(``AuditReport.replayed`` is False and the report says so).

This module reads the checkpoint and gathers each dataset's reader states and in-flight
pieces; the counting that turns them into documents and tokens per epoch (and the per-dataset
types) is in ``consumption.py``, the table and the picture in ``render.py``. This module is
640 lines because the checkpoint's reading, its file checks and the skipped steps' bookkeeping
are one pass over the workers' states.
"""

from __future__ import annotations

import copy
import io
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa

from torchdata_ext.audit import render as _audit_render
from torchdata_ext.audit.consumption import (
    Cursors,
    DatasetAudit,
    EpochConsumption,
    Held,
    audit_dataset,
    document_rows,
    training_side,
)
from torchdata_ext.audit.mix_note import mix_note
from torchdata_ext.audit.segments import MixSegments, mix_segments, run_targets
from torchdata_ext.checkpoint.dcp_entries import is_dcp_checkpoint
from torchdata_ext.checkpoint.dcp_read import read_dcp_manifest, read_dcp_worker_states
from torchdata_ext.checkpoint.folder import read_manifest, read_worker_states
from torchdata_ext.checkpoint.restore import dataset_differs
from torchdata_ext.loader.skip_epochs import UNKNOWN_EPOCH, piece_epochs
from torchdata_ext.nodes.graph_cut import live_cut
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.nodes.shuffle import buffered_provenance
from torchdata_ext.order.shard_walk import latest_epochs
from torchdata_ext.order.shards import file_offsets
from torchdata_ext.pipeline.build import build_datasets, build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig, as_config
from torchdata_ext.remote import write_bytes_atomic
from torchdata_ext.remote.urls import storage_options_of
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
class AuditReport:
    """What a checkpoint says the run consumed (see :mod:`torchdata_ext.audit.report`).

    Attributes:
        checkpoint: the checkpoint's URL (a folder, or a DCP checkpoint).
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
        mix_note: one line when a dataset's token share is 5 points or more off its target:
            which dataset, and why (the mix's quantum and the longest document, per worker;
            or what else moves shares); None when every share is closer.
        mix_segments: achieved vs target shares per segment of the weight changes
            (``weight_schedule``, ``set_weights``) and the lag bound
            (:mod:`torchdata_ext.audit.segments`). With weight changes each dataset's
            ``target_share`` is the segments' targets weighted by their tokens
            (:func:`~torchdata_ext.audit.segments.run_targets`), not the last weights.
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
    mix_note: str | None = None
    mix_segments: MixSegments | None = None
    _cursors: dict[str, Cursors] = field(default_factory=dict, repr=False, compare=False)
    _storage_options: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # per dataset, the (file, doc, epoch) triples with pieces skipped by skip_steps (epoch
    # UNKNOWN_EPOCH: recorded without one, so every epoch's row of the document)
    _step_skipped: dict[str, set[tuple[int, int, int]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (what :meth:`to_json` writes)."""
        out = asdict(self)
        del out["_cursors"], out["_storage_options"], out["_step_skipped"]
        return out

    def to_json(self, indent: int | None = 1) -> str:
        """The report as JSON text (:meth:`to_dict`), for scripts."""
        return json.dumps(self.to_dict(), indent=indent)

    def documents(self) -> pa.Table:
        """One row per document consumed, per epoch from each dataset's ``epoch_min`` on.

        Columns: ``dataset`` and ``file`` (URL; dictionary-encoded strings), ``file_index``
        (the file's number in the dataset's sorted file list), ``doc`` (the document's index
        in its file), ``epoch``, ``in_flight`` (some of its tokens not yet delivered; on the
        row of the latest epoch that consumed it), ``step_skipped`` (some of its tokens of
        that epoch were in the batches of steps ``skip_steps`` skipped; a skip recorded
        without its epoch, by an earlier version, marks every row of the document). Rows are sorted by dataset (config order),
        epoch, file and document. Computed from the cursors on each call (vectorised).
        """
        parts = [document_rows(c) for c in self._cursors.values()]
        names = list(self._cursors)
        ds = np.concatenate([np.full(len(p[0]), i, np.int32) for i, p in enumerate(parts)])
        urls: list[str] = []
        file_ids = []
        for (file, _, _, _), c in zip(parts, self._cursors.values()):
            file_ids.append(file.astype(np.int64) + len(urls))
            urls.extend(c.index.files)
        cols = [np.concatenate([p[k] for p in parts]) for k in range(4)]
        skipped = (
            np.concatenate(
                [
                    np.fromiter(
                        (
                            bool(
                                {(f, d, e), (f, d, UNKNOWN_EPOCH)}
                                & self._step_skipped.get(name, set())
                            )
                            for f, d, e in zip(*(p[k].tolist() for k in range(3)), strict=True)
                        ),
                        bool,
                        count=len(p[0]),
                    )
                    if self._step_skipped.get(name)
                    else np.zeros(len(p[0]), bool)
                    for name, p in zip(names, parts, strict=True)
                ]
            )
            if parts
            else np.zeros(0, bool)
        )
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
                "step_skipped": pa.array(skipped),
            }
        )

    def write_documents(self, url: str, storage_options: dict[str, Any] | None = None) -> int:
        """Write :meth:`documents` to a Parquet file (any fsspec URL, written atomically).

        Args:
            url: the file to write (e.g. ``consumed.parquet``).
            storage_options: fsspec options for ``url`` (default: the audit's, see
                :func:`~torchdata_ext.remote.urls.storage_options_of`).

        Returns:
            The number of rows written.
        """
        import pyarrow.parquet as pq

        table = self.documents()
        buf = io.BytesIO()
        pq.write_table(table, buf)
        write_bytes_atomic(
            url, buf.getvalue(), storage_options_of(storage_options, self._storage_options)
        )
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
            storage_options: fsspec options for ``url`` (default: the audit's, see
                :func:`~torchdata_ext.remote.urls.storage_options_of`).

        Raises:
            ImportError: matplotlib is not installed (``pip install 'torchdata-ext[plot]'``).
        """
        _audit_render.plot(self, url, storage_options_of(storage_options, self._storage_options))


def audit_checkpoint(
    url: str,
    cfg: PipelineConfig | Mapping[str, Any] | str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    replay: bool = True,
    tokens: bool = True,
    verify: bool = False,
    allow_changed_files: bool = False,
    key: str | None = None,
) -> AuditReport:
    """Audit checkpoint ``url`` of a pipeline built from ``cfg``: a checkpoint folder or the
    loader state in a ``torch.distributed.checkpoint`` (the same report).

    Args:
        url: a checkpoint folder written by :func:`~torchdata_ext.checkpoint.folder.save_checkpoint`,
            or a DCP checkpoint holding a :class:`~torchdata_ext.checkpoint.dcp.DCPLoaderState`
            (any fsspec URL).
        cfg: the pipeline config the run used: a :class:`PipelineConfig`, a mapping of its
            fields, or the path of a YAML/JSON config file.
        storage_options: fsspec options for ``url`` and a config file's URL; the data's are
            ``cfg.storage_options``, these when the config has none (and the config's for
            ``url`` when these are None).
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
        key: for a DCP checkpoint, the key of the loader state in the state dict it was saved
            with (``"data"`` for ``dcp.save({..., "data": DCPLoaderState(loader)})``); needed
            only when it holds several. Default: the one loader state there.

    Returns:
        The :class:`AuditReport`.

    Raises:
        FileNotFoundError: ``url`` holds no complete checkpoint.
        ValueError: the checkpoint does not belong to this config and data (another dataset,
            seed or logical shard count, files or counts changed), or a file of it is corrupt;
            a DCP checkpoint holding no loader state, or several and no ``key`` (listed);
            ``key`` for a checkpoint folder;
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
    cfg = as_config(cfg, storage_options)
    if storage_options and not cfg.storage_options:  # given once, they reach every URL
        cfg = copy.copy(cfg)
        cfg.storage_options = storage_options_of(storage_options)
    storage_options = storage_options_of(storage_options, cfg.storage_options)
    manifest, workers = _reader(url, storage_options, key)
    datasets = build_datasets(cfg, World())  # this process alone, never a collective
    _check_matches(url, manifest, cfg, datasets)
    changed: list[str] | None = None
    verified: str | None = None
    if verify:
        changed, verified = _changed_files(url, manifest, datasets, allow_changed_files)
    lengths = {name: ix.doc_lengths() if tokens else None for name, ix in datasets.items()}
    held = {name: Held(ix, lengths[name]) for name, ix in datasets.items()}
    skipped: list[list[Any]] = []
    metas: dict[int, dict[str, Any]] = {}
    live, lagging = _read_workers(
        workers, cfg, datasets, held, replay=replay, skipped=skipped, metas=metas
    )
    cursors, audits = _audit_datasets(manifest, cfg, datasets, live, held, lengths)
    audits = _with_token_shares(_with_step_skips(audits, skipped, cursors, held))
    mixers = int(manifest["world_size"]) * max(1, int(manifest["num_workers"]))
    segments = mix_segments(manifest, [metas[r] for r in sorted(metas)], cfg, lengths)
    targets = run_targets(segments)  # with weight changes: the segments' targets by tokens
    if targets is not None:
        audits = [replace(a, target_share=targets.get(a.name, a.target_share)) for a in audits]
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
        mix_note=mix_note(cfg, audits, lengths, mixers),
        mix_segments=segments,
        _cursors=cursors,
        _storage_options=storage_options,
        _step_skipped={
            name: {
                (int(p[1]), int(p[2]), int(e))
                for p, e in zip(skipped, piece_epochs(skipped).tolist(), strict=True)
                if p[0] == name
            }
            for name in datasets
        },
    )


def _changed_files(
    url: str,
    manifest: dict[str, Any],
    datasets: dict[str, DatasetIndex],
    allow_changed_files: bool,
) -> tuple[list[str], str]:
    """The data files changed since the checkpoint (``dataset/file: what differs``) and what
    was compared, from the fingerprints the checkpoint recorded.

    Raises:
        ValueError: the checkpoint records no fingerprints.
        ChangedFilesError: files changed and not ``allow_changed_files``.
    """
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
    return changed, compared(recorded, datasets)


def _reader(
    url: str, storage_options: dict[str, Any] | None, key: str | None
) -> tuple[dict[str, Any], Iterator[tuple[World, dict[str, Any], dict[str, Any]]]]:
    """The manifest of checkpoint ``url`` (a folder or a DCP checkpoint) and its workers'
    states, read one at a time as the caller goes (the same dicts either way)."""
    if is_dcp_checkpoint(url, storage_options):
        return (
            read_dcp_manifest(url, storage_options, key=key),
            read_dcp_worker_states(url, storage_options, key=key),
        )
    if key is not None:
        raise ValueError(
            f"key={key!r} picks a loader state in a torch.distributed.checkpoint (DCP), but "
            f"{url} is not one (no .metadata): a checkpoint folder holds one loader state; "
            "leave key out"
        )
    return read_manifest(url, storage_options), read_worker_states(url, storage_options)


def _read_workers(
    states: Iterator[tuple[World, dict[str, Any], dict[str, Any]]],
    cfg: PipelineConfig,
    datasets: dict[str, DatasetIndex],
    held: dict[str, Held],
    *,
    replay: bool,
    skipped: list[list[Any]],
    metas: dict[int, dict[str, Any]],
) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """Every worker's state in the checkpoint read: the pieces its shuffle buffer and (with
    ``replay``) its pipeline hold go into ``held``. Returns each dataset's reader states, one
    per worker (live with ``replay``, else as recorded), and the batches delivered after the
    workers' last snapshots (summed once per rank); each rank's pieces skipped by
    ``skip_steps`` go into ``skipped``, each rank's entry into ``metas``."""
    live: dict[str, list[dict[str, Any]]] = {name: [] for name in datasets}
    lagging = 0
    counted_ranks: set[int] = set()
    for world, meta, graph in states:
        if world.rank not in counted_ranks:
            counted_ranks.add(world.rank)
            metas[world.rank] = meta
            lagging += int(meta.get("skip_batches", 0))
            skipped.extend(meta.get("skipped_documents", []))
        # the outermost pack and shuffle buffer; every mix (one per curriculum phase)
        pack_state = next(iter(pack_states(graph).values()), None)  # the outermost
        shuffle_state = next(iter(shuffle_states(graph).values()), None)
        names = list(pack_state["dataset_names"]) if pack_state else list(datasets)
        if shuffle_state is not None:
            _hold_buffered(shuffle_state, names, held)
        if replay and pack_state is not None:
            readers = _replayed_readers(cfg, world, datasets, pack_state, held)
        else:
            readers = _recorded_readers(graph)
        for name, st in readers.items():
            live[name].append(st)
    return live, lagging


def _hold_buffered(shuffle_state: dict[str, Any], names: list[str], held: dict[str, Held]) -> None:
    """The pieces of the sequences in a shuffle buffer's state, as held by it (``names``: the
    pack's datasets, by the numbers its provenance rows use)."""
    _, rows = buffered_provenance(shuffle_state)
    rows = rows[(rows[:, 0] >= 0) & (rows[:, 4] > 0)]
    for i, name in enumerate(names):
        mine = rows[rows[:, 0] == i]
        stop = mine[:, 3] + mine[:, 4]
        held[name].add("shuffle_buffer", np.column_stack([mine[:, 1:4], stop]))


def _replayed_readers(
    cfg: PipelineConfig,
    world: World,
    datasets: dict[str, DatasetIndex],
    pack_state: dict[str, Any],
    held: dict[str, Held],
) -> dict[str, dict[str, Any]]:
    """The live reader states of one worker, by dataset, from restoring its pack (or, when
    the pack holds nothing, what feeds it) and taking a consistent cut; the pieces held above
    the readers go into ``held``."""
    root = build_pipeline(cfg, world, datasets, collate=False)
    pack = next(n for n in graph_nodes(root) if isinstance(n, Pack))
    if int(pack_state["consumed"]) or int(pack_state["bins"]):
        readers, cut, _ = live_cut(pack, pack_state)
    else:  # the pack holds nothing: its replay would only pull a block it never used
        readers, cut, _ = live_cut(pack.source, pack_state[Pack.SOURCE_KEY])
    for name in datasets:
        held[name].add("pipeline", [p[1:] for p in cut if p[0] == name])
    return readers


def _recorded_readers(graph: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The outermost state of each reader in one worker's graph state, by dataset (a
    curriculum's phases repeat it)."""
    readers: dict[str, dict[str, Any]] = {}
    for st in reader_states({"graph": graph}).values():
        readers.setdefault(st["dataset"], st)
    return readers


def _audit_datasets(
    manifest: dict[str, Any],
    cfg: PipelineConfig,
    datasets: dict[str, DatasetIndex],
    live: dict[str, list[dict[str, Any]]],
    held: dict[str, Held],
    lengths: dict[str, np.ndarray | None],
) -> tuple[dict[str, Cursors], list[DatasetAudit]]:
    """Each dataset's workers' reader states merged and counted (:func:`audit_dataset`),
    with the pieces a rescale handed back and its target share of the weights the checkpoint
    recorded; in the config's order."""
    weights = {name: manifest["datasets"][name].get("weight") for name in datasets}
    total_w = sum(w for w in weights.values() if w is not None)
    audits: list[DatasetAudit] = []
    cursors: dict[str, Cursors] = {}
    for name, index in datasets.items():
        merged = merge_reader_states(live[name])
        back = [p for ex in reader_cursors(merged).extras.values() for p in ex.get("returned", [])]
        held[name].add("handed_back", back)
        w = weights[name]
        c, audit = audit_dataset(
            index,
            merged,
            held[name],
            lengths[name],
            training_side(index, cfg.eval_split(name)),
            weight=w,
            target_share=None if w is None or not total_w else w / total_w,
        )
        cursors[name] = c
        audits.append(audit)
    return cursors, audits


def _with_step_skips(
    audits: list[DatasetAudit],
    skipped: list[list[Any]],
    cursors: dict[str, Cursors],
    held: dict[str, Held],
) -> list[DatasetAudit]:
    """``audits`` with the pieces ``[dataset, file, doc, start, length, epoch]`` of the steps
    skipped by ``skip_steps`` counted as skipped: each document's skipped pass (a document and
    an epoch) leaves the delivered counts, unless it is the pass still in flight (counted
    there: its epoch is the latest the document was consumed in, or the piece has no epoch),
    and so do the pieces' tokens."""
    out = []
    for a in audits:
        mine = [p for p in skipped if p[0] == a.name]
        if not mine:
            out.append(a)
            continue
        arr = np.asarray([p[1:5] for p in mine], np.int64).reshape(-1, 4)
        c = cursors[a.name]
        offsets = file_offsets(c.index.doc_counts)
        passes = np.unique(
            np.column_stack([offsets[arr[:, 0]] + arr[:, 1], piece_epochs(mine)]), axis=0
        )
        ids, epochs = passes[:, 0], passes[:, 1]
        latest = latest_epochs(
            offsets, c.n_logical_shards, c.seed, (c.shard, c.epoch, c.pos, c.offset), ids
        )
        flying = np.isin(ids, held[a.name].documents())
        gone = int((~(flying & ((epochs == UNKNOWN_EPOCH) | (epochs == latest)))).sum())
        tokens = int(arr[:, 3].sum())
        out.append(
            replace(
                a,
                step_skipped_documents=len(passes),
                step_skipped_tokens=tokens,
                documents_delivered=None
                if a.documents_delivered is None
                else a.documents_delivered - gone,
                tokens_delivered=None
                if a.tokens_delivered is None
                else a.tokens_delivered - tokens,
            )
        )
    return out


def _with_token_shares(audits: list[DatasetAudit]) -> list[DatasetAudit]:
    """``audits`` with each dataset's share of all the tokens delivered (unchanged while
    nothing is delivered or some dataset's tokens are unknown)."""
    got = [a.tokens_delivered for a in audits]
    total = sum(t for t in got if t is not None)
    if total and None not in got:
        return [replace(a, token_share=(a.tokens_delivered or 0) / total) for a in audits]
    return audits


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
