"""Checkpoints of the loader: a folder on any fsspec URL, or inside a DCP checkpoint.

Folder layout (``url/``)::

    manifest.json            format, topology (ranks, workers), logical shards, fingerprints
                             (of each dataset, and of each data file: file_fingerprints)
    rank_00000.json          per rank: which logical worker produces the next batch, and the
                             sha256 of each of the rank's worker files
    worker_000000.pkl        per global worker: its graph state (pickled plain data)

Every file is written atomically (:func:`torchdata_ext.remote.write_bytes_atomic`), so a kill
never leaves a half-written file; the manifest is written last (after a barrier when
``torch.distributed`` is initialised), so a folder without a manifest is an incomplete
checkpoint and is refused. A save into a folder that holds a checkpoint first removes its
manifest, so a save that fails or is killed half-way never leaves the old manifest over a mix
of old and new files (the old checkpoint is lost then: save each step into its own folder to
always keep the last complete one).

Checksums: a file damaged after the save is refused, naming it, before anything is restored.
Each rank hashes the worker files it writes and records the digests in its ``rank_*.json``
(no rank reads another's files at save time); each JSON file carries the sha256 of its own
content (the canonical JSON without that key) under ``"sha256"``; the manifest says
``"checksums": "sha256"``. A load checks exactly the files it reads. Checkpoints written before
checksums (no ``"checksums"`` in the manifest) still load, unchecked.

Data files: the manifest records each data file's fingerprint (:mod:`torchdata_ext.sources.fingerprint`)
under ``"file_fingerprints"``; a load refuses a file changed in place, naming it, before anything
is restored (unless ``allow_changed_files=True``). A ``torch.distributed.checkpoint``
(:class:`DCPLoaderState`) records, per rank, that rank's share of the fingerprints.

Restoring onto another number of ranks x workers (:func:`load_checkpoint`): each new worker
reads only the old workers' files it needs (the old owners of its logical shards) and
:mod:`torchdata_ext.checkpoint.rescale` plans its state from them (merged reader cursors of its shards,
in-flight data handed back, interleave token counters re-split), so the epoch goes on with
nothing repeated and nothing lost. A DCP checkpoint (:class:`DCPLoaderState`) restores the same
way, through the same :func:`_restore`, from the entries ``dcp.load`` read for this rank.

Why ~730 lines, one module: the folder and DCP checkpoints share the manifest checks, the
restore and the rescale call (one definition each); the DCP key layout and the choice of
entries to read live apart, in :mod:`torchdata_ext.checkpoint.dcp_entries`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
import posixpath
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torchdata.nodes import BaseNode

from torchdata_ext.checkpoint import dcp_entries as _dcp_entries
from torchdata_ext.checkpoint.rescale import old_workers_needed, rescale_worker_states
from torchdata_ext.loader.token_loader import STATE_FORMAT, TokenLoader
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.nodes.reader import ShardReader
from torchdata_ext.remote import remove_file, write_bytes_atomic
from torchdata_ext.remote.urls import filesystem
from torchdata_ext.sources.fingerprint import (
    SAMPLE_BYTES,
    check_data_files,
    check_share,
    dataset_fingerprints,
    describe,
    fingerprint_share,
    is_collective,
    listed_changes,
)
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.state.graph import graph_nodes, graph_summary, phase_datasets
from torchdata_ext.world import World

__all__ = [
    "CHECKPOINT_FORMAT",
    "DCPLoaderState",
    "dataset_differs",
    "is_checkpoint_folder",
    "load_checkpoint",
    "read_manifest",
    "read_worker_states",
    "rescale_worker_states",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
_MANIFEST = "manifest.json"
_CHECKSUMS = "sha256"  # the manifest's "checksums": the hash of every file of the checkpoint


# -- file I/O -----------------------------------------------------------------------------------
def _read(url: str, storage_options: dict[str, Any] | None) -> bytes:
    """The bytes of checkpoint file ``url``; a missing file says the checkpoint is incomplete."""
    fs, path = filesystem(url, storage_options)
    try:
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"checkpoint file {url} is missing: the checkpoint is incomplete or from another "
            "topology; pass the folder of a complete checkpoint"
        ) from None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj: dict[str, Any]) -> str:
    """``obj`` as the JSON text that is written and hashed (keys sorted)."""
    return json.dumps(obj, indent=1, sort_keys=True)


def _sealed_json(obj: dict[str, Any]) -> bytes:
    """``obj`` as JSON with the sha256 of its own canonical JSON under ``"sha256"``."""
    body = json.loads(_canonical(obj))  # as it reads back (keys as strings, tuples as lists)
    return _canonical({**body, "sha256": _sha256(_canonical(body).encode())}).encode()


def _corrupt(url: str, why: str) -> ValueError:
    return ValueError(
        f"checkpoint file {url} is corrupt ({why}): it was damaged or changed after the save; "
        "restore from another checkpoint"
    )


def _read_json(url: str, storage_options: dict[str, Any] | None, checked: bool) -> dict[str, Any]:
    """A checkpoint JSON file, checked against its own sha256 (required when ``checked``, or
    when the file says the checkpoint has checksums)."""
    raw = _read(url, storage_options)
    try:
        obj = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise _corrupt(url, f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _corrupt(url, f"a JSON {type(obj).__name__}, not an object")
    digest = obj.pop("sha256", None)
    if digest is None and (checked or "checksums" in obj):
        raise _corrupt(url, "its sha256 is missing")
    if digest is not None and digest != _sha256(_canonical(obj).encode()):
        raise _corrupt(url, "its content does not match its sha256")
    return obj


def _worker_name(g: int) -> str:
    return f"worker_{g:06d}.pkl"


def _rank_name(r: int) -> str:
    return f"rank_{r:05d}.json"


def _read_rank(
    url: str, r: int, storage_options: dict[str, Any] | None, checked: bool
) -> dict[str, Any]:
    """Old rank ``r``'s ``rank_*.json`` (with the sha256 of its worker files when ``checked``)."""
    rank_url = posixpath.join(url, _rank_name(r))
    meta = _read_json(rank_url, storage_options, checked)
    if checked and "files" not in meta:
        raise _corrupt(rank_url, "it records no sha256 of its worker files")
    return meta


def _read_worker(
    url: str, g: int, rank_meta: dict[str, Any], storage_options: dict[str, Any] | None
) -> dict[str, Any]:
    """Global worker ``g``'s graph state, checked against the sha256 its rank recorded (when
    the checkpoint has checksums: ``rank_meta`` is that rank's file)."""
    file_url = posixpath.join(url, _worker_name(g))
    raw = _read(file_url, storage_options)
    if "files" in rank_meta:
        expected = rank_meta["files"].get(_worker_name(g))
        if expected is None:
            raise _corrupt(file_url, "its rank file records no sha256 for it")
        if expected != _sha256(raw):
            raise _corrupt(file_url, "its sha256 differs from the one its rank file recorded")
    try:
        graph: dict[str, Any] = pickle.loads(raw)["graph"]
        return graph
    except Exception as exc:  # a truncated pickle fails in many ways
        raise ValueError(
            f"checkpoint file {file_url} cannot be unpickled ({type(exc).__name__}: {exc}): it "
            "is truncated or corrupt; restore from another checkpoint"
        ) from exc


# -- folder checkpoints -------------------------------------------------------------------------------
def save_checkpoint(
    loader: TokenLoader, url: str, *, storage_options: dict[str, Any] | None = None
) -> None:
    """Write this rank's part of the loader checkpoint into folder ``url`` (atomically).

    Call on every rank at the same step. Rank 0 removes the manifest of an earlier checkpoint
    in ``url`` first and writes the new one last, so ``url`` is a complete checkpoint only once
    every rank's files are written.

    Args:
        loader: the loader, at the step to checkpoint.
        url: the checkpoint folder (any fsspec URL; created if missing).
        storage_options: fsspec options for ``url``.
    """
    state = loader.state_dict()
    # before anything in url changes: a failure here leaves an earlier checkpoint there intact
    configured = None
    data_files: dict[str, Any] = {}
    if loader.rank == 0 or is_collective(loader.world_size):
        configured = _loader_config(loader)
        data_files = dataset_fingerprints(
            configured[0], rank=loader.rank, world_size=loader.world_size
        )
    _start_save(url, loader.rank, storage_options)
    files = {}
    for g, st in state["workers"].items():
        data = pickle.dumps(st, protocol=pickle.HIGHEST_PROTOCOL)
        write_bytes_atomic(posixpath.join(url, _worker_name(int(g))), data, storage_options)
        files[_worker_name(int(g))] = _sha256(data)
    meta = {
        "next_worker": state["next_worker"],
        "skip_batches": state["skip_batches"],
        "files": files,
    }
    write_bytes_atomic(
        posixpath.join(url, _rank_name(loader.rank)), _sealed_json(meta), storage_options
    )
    _barrier()
    if loader.rank == 0 and configured is not None:
        any_graph = next(iter(state["workers"].values()))["graph"]
        datasets = graph_summary(any_graph)
        # the weights are the pipeline's targets (a state restored with new weights and not
        # yet run still holds the old ones)
        for name, summary in configured[1].items():
            if name in datasets:
                datasets[name]["weight"] = summary["weight"]
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "loader_format": STATE_FORMAT,
            "world_size": loader.world_size,
            "num_workers": loader.logical_workers,
            "datasets": datasets,
            "checksums": _CHECKSUMS,
            "file_fingerprints": {"sample_bytes": SAMPLE_BYTES, "datasets": data_files},
        }
        write_bytes_atomic(posixpath.join(url, _MANIFEST), _sealed_json(manifest), storage_options)
    _barrier()


def _start_save(url: str, rank: int, storage_options: dict[str, Any] | None) -> None:
    """Mark folder ``url`` incomplete before any of its files changes: rank 0 removes the
    manifest of an earlier save there, then every rank waits for that."""
    if rank == 0:
        remove_file(posixpath.join(url, _MANIFEST), storage_options)
    _barrier()


def _barrier() -> None:
    """Wait for every rank when ``torch.distributed`` is initialised (else return at once)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def read_manifest(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of checkpoint folder ``url``.

    Raises:
        FileNotFoundError: no manifest (not a checkpoint, or its save did not finish).
        ValueError: a checkpoint format this version does not read, or a corrupt manifest.
    """
    try:
        manifest = _read_json(posixpath.join(url, _MANIFEST), storage_options, checked=False)
    except FileNotFoundError:
        fs, path = filesystem(url, storage_options)
        if not fs.exists(path):
            raise FileNotFoundError(
                f"checkpoint folder {url} does not exist (so no {_MANIFEST}): check the "
                f"path{_beside(fs, path)}"
            ) from None
        raise FileNotFoundError(
            f"{url} has no {_MANIFEST}: not a loader checkpoint, or one whose save did not finish "
            "(a kill during save); restore from an earlier checkpoint"
        ) from None
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{url}: checkpoint format {manifest.get('format')!r} is not supported "
            f"(this version reads format {CHECKPOINT_FORMAT})"
        )
    return manifest


def is_checkpoint_folder(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``url`` is a folder holding a loader checkpoint (its ``manifest.json`` and
    ``rank_00000.json``), e.g. to refuse reading one as a dataset."""
    fs, path = filesystem(url, storage_options)
    return bool(
        fs.isfile(posixpath.join(path, _MANIFEST))
        and fs.isfile(posixpath.join(path, "rank_00000.json"))
    )


def _beside(fs: Any, path: str, limit: int = 8) -> str:
    """``"; <parent> holds: a, b, ..."`` (the folders beside a missing ``path``), or ``""``."""
    parent = posixpath.dirname(path.rstrip("/"))
    try:
        names = sorted(
            posixpath.basename(p.rstrip("/")) for p in fs.ls(parent or ".", detail=False)
        )
    except OSError:
        return ""
    if not names:
        return ""
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return f" ({parent or '.'} holds: {', '.join(names[:limit])}{more})"


def read_worker_states(
    url: str, storage_options: dict[str, Any] | None = None
) -> Iterator[tuple[World, dict[str, Any], dict[str, Any]]]:
    """Every worker's graph state in checkpoint folder ``url``, one at a time (each checked
    against the sha256 its rank recorded), for tools that look at a whole checkpoint.

    Args:
        url: the checkpoint folder (any fsspec URL).
        storage_options: fsspec options for ``url``.

    Yields:
        ``(world, rank_meta, graph)``: the worker's place when the checkpoint was taken, its
        rank's ``rank_*.json`` (``next_worker``, ``skip_batches``) and its graph state.
    """
    manifest = read_manifest(url, storage_options)
    checked = manifest.get("checksums") == _CHECKSUMS
    ranks, workers = int(manifest["world_size"]), int(manifest["num_workers"])
    for r in range(ranks):
        meta = _read_rank(url, r, storage_options, checked)
        for w in range(workers):
            graph = _read_worker(url, r * workers + w, meta, storage_options)
            yield World(r, ranks, w, workers), meta, graph


def load_checkpoint(
    loader: TokenLoader,
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    allow_weight_changes: bool = False,
    allow_new_datasets: bool = False,
    allow_changed_files: bool = False,
) -> None:
    """Restore ``loader`` (not yet iterating) from folder ``url``, rescaling if the number of
    ranks or workers changed. Reads only the files this rank needs.

    Args:
        loader: a new loader with the same pipeline builder.
        url: the checkpoint folder (any fsspec URL).
        storage_options: fsspec options for ``url``.
        allow_weight_changes: accept sub-dataset weights that differ from the checkpoint's
            (the token counters carry on; the mix moves to the new targets).
        allow_new_datasets: accept sub-datasets that the checkpoint does not have; they start
            their first epoch, at their target share of the tokens so far. Documents of the
            other datasets already delivered stay delivered.
        allow_changed_files: accept data files whose fingerprint (size, mtime or ETag, first
            and last 64 KiB) differs from the saved one, with a warning naming them: only for
            harmless changes (the same bytes copied without keeping modification times).

    Raises:
        ChangedFilesError: a data file changed since the save (a ``ValueError`` naming the
            files and what differs; see :mod:`torchdata_ext.sources.fingerprint`).
        ValueError: the checkpoint is of other data, seed, logical shards or weights, its
            curriculum phases read other datasets (phases listed in another order), or one of
            its files is corrupt. Datasets are matched by name: the same datasets listed in
            another order (same weight per name) restore.
        FileNotFoundError: no complete checkpoint at ``url``.
    """
    manifest = read_manifest(url, storage_options)
    checked = manifest.get("checksums") == _CHECKSUMS

    def check_files(datasets: dict[str, DatasetIndex]) -> None:
        check_data_files(
            manifest.get("file_fingerprints"),
            datasets,
            rank=loader.rank,
            world_size=loader.world_size,
            allow_changed_files=allow_changed_files,
            where=f"loader checkpoint {url}",
        )

    _restore(
        loader,
        manifest,
        f"checkpoint {url}",
        rank_meta=lambda r: _read_rank(url, r, storage_options, checked),
        worker=lambda g, meta: _read_worker(url, g, meta, storage_options),
        check_files=check_files,
        allow_weight_changes=allow_weight_changes,
        allow_new_datasets=allow_new_datasets,
    )


def _restore(
    loader: TokenLoader,
    manifest: dict[str, Any],
    where: str,
    *,
    rank_meta: Callable[[int], dict[str, Any]],
    worker: Callable[[int, dict[str, Any]], dict[str, Any]],
    check_files: Callable[[dict[str, DatasetIndex]], Any],
    allow_weight_changes: bool,
    allow_new_datasets: bool,
) -> None:
    """Restore ``loader`` from a checkpoint, folder or DCP (``where`` names it in messages):
    ``manifest`` (topology, datasets), ``rank_meta(r)`` (old rank ``r``'s ``next_worker`` and
    ``skip_batches``) and ``worker(g, rank_meta)`` (old global worker ``g``'s graph state) read
    only what this rank needs; ``check_files`` refuses changed data files. The same topology
    restores the rank's own states; another one is planned by :mod:`torchdata_ext.checkpoint.rescale`."""
    old_ranks, old_workers = int(manifest["world_size"]), int(manifest["num_workers"])
    W = loader.logical_workers
    root, mine = _configured(loader)
    added, reweighted = _check_datasets(
        root, mine, manifest, allow_weight_changes, allow_new_datasets
    )
    check_files(_datasets_of(root))
    if (old_ranks, old_workers) == (loader.world_size, W) and not added:
        meta = rank_meta(loader.rank)
        graphs = {w: worker(loader.rank * W + w, meta) for w in range(W)}
        _check_phases(where, root, graphs[0])
        if reweighted and int(meta.get("skip_batches", 0)):
            raise ValueError(
                f"{where} was taken {meta['skip_batches']} batches after the workers' "
                f"last state snapshot; those batches are made again on restore, which needs the "
                f"weights they were made with, so the weights of {reweighted} cannot change here: "
                "restore with the checkpoint's weights, or change them at a checkpoint taken at a "
                "multiple of snapshot_every_n_steps"
            )
        loader.load_worker_states(
            graphs,
            next_worker=meta["next_worker"],
            skip_batches=int(meta.get("skip_batches", 0)),
        )
        return
    old_total = old_ranks * old_workers
    n = next(iter(manifest["datasets"].values()))["n_logical_shards"]
    worlds = [World(loader.rank, loader.world_size, w, W) for w in range(W)]
    needed = {w.worker_id: old_workers_needed(n, old_total, w) for w in worlds}
    # every entry this rank needs is read (and checked) before any state is planned
    metas = {
        r: rank_meta(r) for r in sorted({g // old_workers for gs in needed.values() for g in gs})
    }
    for r, meta in metas.items():  # each old rank that owned a needed worker must be at a snapshot
        if int(meta.get("skip_batches", 0)):
            raise ValueError(
                f"{where}: rank {r} saved its state {meta['skip_batches']} batches after "
                "its workers' last snapshot (snapshot_every_n_steps > 1), so the checkpoint "
                f"restores only on the same {old_ranks} ranks x {old_workers} workers; to "
                "rescale, take checkpoints at multiples of snapshot_every_n_steps (or use "
                "snapshot_every_n_steps=1)"
            )
    cache = {
        g: worker(g, metas[g // old_workers])
        for g in sorted({g for gs in needed.values() for g in gs})
    }
    _check_phases(where, root, next(iter(cache.values())))
    new_graphs = {
        w.worker_id: rescale_worker_states(
            cache, (old_ranks, old_workers), w, loader.build, allow_new_datasets=bool(added)
        )
        for w in worlds
    }
    logger.info(
        "rescaled loader %s from %dx%d to %dx%d (read %d of %d worker states)",
        where, old_ranks, old_workers, loader.world_size, W, len(cache), old_total,
    )  # fmt: skip
    loader.load_worker_states(new_graphs, next_worker=0)


def _configured(loader: TokenLoader) -> tuple[BaseNode, dict[str, Any]]:
    """A fresh graph of ``loader``'s pipeline (this rank, worker 0) and its summary: the
    datasets, seeds, shard counts and target weights as configured now."""
    root = loader.build(World(loader.rank, loader.world_size, 0, loader.logical_workers))
    root.reset(None)
    return root, graph_summary(root.state_dict())


def _check_datasets(
    root: BaseNode,
    mine: dict[str, Any],
    manifest: dict[str, Any],
    allow_weight_changes: bool = False,
    allow_new_datasets: bool = False,
) -> tuple[list[str], list[str]]:
    """Refuse a checkpoint of other data than graph ``root`` (summary ``mine``, from
    :func:`_configured`); return the names of the accepted added datasets and of those whose
    weight changed (accepted)."""
    theirs = manifest["datasets"]
    problems = []
    added: list[str] = []
    reweighted: list[str] = []
    for name in sorted(set(mine) | set(theirs)):
        if name not in mine:
            problems.append(f"dataset {name!r} is in the checkpoint but not in this pipeline")
        elif name not in theirs:
            if allow_new_datasets:
                added.append(name)
            else:
                problems.append(
                    f"dataset {name!r} is in this pipeline but not in the checkpoint "
                    "(pass allow_new_datasets=True to add it)"
                )
        else:
            old_w, new_w = theirs[name].get("weight"), mine[name].get("weight")
            if old_w is not None and new_w is not None and old_w != new_w:
                if allow_weight_changes:
                    reweighted.append(name)
                else:
                    problems.append(
                        f"dataset {name!r}: weight differs (checkpoint {old_w}, now {new_w}; "
                        "pass allow_weight_changes=True to accept it)"
                    )
            for key in ("fingerprint", "seed", "n_logical_shards", "split"):
                if mine[name].get(key) != theirs[name].get(key):
                    index = _datasets_of(root).get(name) if key == "fingerprint" else None
                    problems.append(
                        dataset_differs(
                            name, key, theirs[name].get(key), mine[name].get(key), manifest, index
                        )  # fmt: skip
                    )
    if problems:
        raise ValueError(
            "cannot restore this loader checkpoint: "
            + "; ".join(problems)
            + ". Restore with the same data, seed and logical shards as the checkpoint"
        )
    if (added or reweighted) and any(
        isinstance(x, Pack) and x.mode == "best_fit" for x in graph_nodes(root)
    ):
        raise ValueError(
            f"cannot change the mix on restore (weights of {reweighted}, added {added}) with "
            "pack_mode='best_fit': its window is rebuilt from many interleave blocks, which "
            "must come out as they did under the checkpoint's weights; restore with the "
            "checkpoint's datasets and weights, or use pack_mode 'concat' or 'pad'"
        )
    return added, reweighted


def _check_phases(url: str, root: BaseNode, graph: dict[str, Any]) -> None:
    """Refuse a checkpoint whose curriculum phases read other datasets than this pipeline's
    phases in the same places: a phase's state and budget are matched by its place, so
    phases listed in another order would restore one phase's state into another (the
    readers and mixes would refuse it, but a rescale would hand one phase's budget to another)."""
    theirs = phase_datasets(graph)
    saved = {n for names in theirs.values() for n in names}  # datasets added since: not matched
    mine = {
        k: kept
        for k, names in phase_datasets(root.state_dict()).items()
        if (kept := [n for n in names if n in saved])
    }
    differ = [
        f"phase {k[-1]}: checkpoint {theirs.get(k)}, now {mine.get(k)}"
        for k in sorted(set(mine) | set(theirs), key=str)
        if mine.get(k) != theirs.get(k)
    ]
    if differ:
        raise ValueError(
            f"cannot restore {url}: its curriculum phases read other datasets "
            f"({'; '.join(differ)}); list the phases in the checkpoint's order"
        )


def dataset_differs(
    name: str,
    key: str,
    saved: Any,
    now: Any,
    manifest: dict[str, Any],
    index: DatasetIndex | None = None,
) -> str:
    """The one description of dataset ``name`` differing from a checkpoint in ``key``
    (``"fingerprint"``, ``"seed"``, ``"n_logical_shards"``, ``"split"``), used by
    :func:`load_checkpoint` and :func:`~torchdata_ext.audit.report.audit_checkpoint`: for the
    fingerprint, the files missing, added or resized since the save are named (from the listing
    of ``index``, the dataset now, against the manifest's recorded file fingerprints)."""
    what = {"fingerprint": "files or document counts", "split": "held-out split"}.get(key, key)
    listed = ""
    recorded = manifest.get("file_fingerprints", {}).get("datasets", {}).get(name)
    if key == "fingerprint" and recorded is not None and index is not None:
        changes = listed_changes(recorded, index)
        listed = f"; changed files: {describe({name: changes})}" if changes else ""
    return f"dataset {name!r}: {what} differ (checkpoint {key}={saved!r}, now {now!r}{listed})"


def _datasets_of(root: BaseNode) -> dict[str, DatasetIndex]:
    """The datasets a graph reads, by name."""
    return {n.dataset.name: n.dataset for n in graph_nodes(root) if isinstance(n, ShardReader)}


# -- torch.distributed.checkpoint -------------------------------------------------------------------
class DCPLoaderState:
    """Put the loader state into the same ``torch.distributed.checkpoint`` as the model, and
    restore it from there at any number of ranks x workers.

    ``dcp.save({"model": ..., "optim": ..., "data": DCPLoaderState(loader)}, checkpoint_id=...)``
    stores a manifest (topology and datasets, once), an entry per rank and an entry per worker
    (see :mod:`torchdata_ext.checkpoint.dcp_entries`); ranks never overwrite each other.
    ``dcp.load({..., "data": DCPLoaderState(loader)}, checkpoint_id=...)`` restores it, on the
    same topology or another (more or fewer ranks, other workers, 0 included), with the
    guarantees of :func:`load_checkpoint`: each rank reads only the manifest, the entries of the
    old workers that owned its logical shards and a share of the rank entries; the old workers'
    in-flight data is handed on (:mod:`torchdata_ext.checkpoint.rescale`), and a checkpoint of other data,
    seed or logical shards is refused, saying why. Works with any DCP storage
    (``FileSystemWriter``/``Reader``, ``FsspecWriter``/``Reader`` on ``s3://``...).

    Each rank also records the fingerprints of its share of the data files (every
    ``world_size``-th file: :func:`~torchdata_ext.sources.fingerprint.fingerprint_share`); a load refuses
    a data file changed in place since, naming it, on every rank (new rank ``r`` checks the
    shares of old ranks ``r, r + world_size, ...``). A state saved before fingerprints were
    recorded loads unchecked; one saved before entries per worker (one ``rank_*`` entry per
    rank) restores on the same topology only.

    Args:
        loader: the loader whose state is saved and restored (restore before iterating).
        allow_weight_changes / allow_new_datasets / allow_changed_files: as for
            :func:`load_checkpoint`.
    """

    def __init__(
        self,
        loader: TokenLoader,
        *,
        allow_weight_changes: bool = False,
        allow_new_datasets: bool = False,
        allow_changed_files: bool = False,
    ) -> None:
        self.loader = loader
        self.allow_weight_changes = allow_weight_changes
        self.allow_new_datasets = allow_new_datasets
        self.allow_changed_files = allow_changed_files

    def state_dict(self, owner: object | None = None) -> dict[str, Any]:
        """The entries to save (each a ``BytesIO`` of a pickle, which DCP stores as is); inside
        ``dcp.load``, the entries this rank reads (see the class).

        Args:
            owner: the object the user's state dict holds, when this one works for it (the
                torchtitan data loader); default: this object.
        """
        found = _dcp_entries.loading_from(self if owner is None else owner)
        if found is not None:
            reader, prefix = found
            return dict.fromkeys(self._entries_to_read(reader, prefix), io.BytesIO())
        loader = self.loader
        state = loader.state_dict()
        datasets, summary = _loader_config(loader)
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "loader_format": STATE_FORMAT,
            "world_size": loader.world_size,
            "num_workers": loader.logical_workers,
            "datasets": summary,
        }
        meta = {
            "next_worker": state["next_worker"],
            "skip_batches": state["skip_batches"],
            "file_fingerprints": fingerprint_share(
                datasets, rank=loader.rank, world_size=loader.world_size
            ),
        }
        out = {
            _dcp_entries.MANIFEST: _pickled(manifest),
            _dcp_entries.rank_key(loader.rank): _pickled(meta),
        }
        for g, st in state["workers"].items():
            out[_dcp_entries.worker_key(int(g))] = _pickled(st)
        return out

    def _entries_to_read(self, reader: Any, prefix: str) -> list[str]:
        """The keys this rank asks ``dcp.load`` for, from the checkpoint's list of keys."""
        loader = self.loader
        keys = _dcp_entries.keys_under(reader.read_metadata(), prefix)
        old = _dcp_entries.topology_of(keys)
        if old is None:  # saved before entries per worker: this rank's entry, same topology
            return [_dcp_entries.rank_key(loader.rank)]
        shards = {d["n_logical_shards"] for d in _loader_config(loader)[1].values()}
        return _dcp_entries.entries_to_read(
            old, min(shards), loader.rank, loader.world_size, loader.logical_workers
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loader from the entries ``dcp.load`` read (see :meth:`state_dict`).

        Raises:
            ChangedFilesError: a data file changed since the save (see the class).
            ValueError: a checkpoint of other data, seed or logical shards (saying which), or
                entries this rank needs are missing.
        """
        if _dcp_entries.MANIFEST not in state:
            self._load_single(state)
            return
        entries = {k: _unpickled(v) for k, v in state.items()}
        where = "the loader state in the DCP checkpoint"
        loader = self.loader

        def entry(key: str) -> dict[str, Any]:
            try:
                return entries[key]
            except KeyError:
                raise ValueError(
                    f"{where} was loaded without its entry {key!r}: restore through "
                    "dcp.load({..., key: DCPLoaderState(loader)}), which reads the entries this "
                    "rank needs"
                ) from None

        shares = [
            m["file_fingerprints"]
            for k, m in entries.items()
            if (r := _dcp_entries.rank_of(k)) is not None and r % loader.world_size == loader.rank
        ]
        recorded = (
            {"sample_bytes": shares[0]["sample_bytes"],
             "datasets": _merged_shares(s["datasets"] for s in shares)}
            if shares
            else {"sample_bytes": SAMPLE_BYTES, "datasets": {}}
        )  # fmt: skip
        _restore(
            loader,
            {**entry(_dcp_entries.MANIFEST), "file_fingerprints": recorded},
            where,
            rank_meta=lambda r: entry(_dcp_entries.rank_key(r)),
            worker=lambda g, _meta: entry(_dcp_entries.worker_key(g))["graph"],
            check_files=lambda datasets: check_share(
                recorded,
                datasets,
                world_size=loader.world_size,
                allow_changed_files=self.allow_changed_files,
                where=where,
            ),
            allow_weight_changes=self.allow_weight_changes,
            allow_new_datasets=self.allow_new_datasets,
        )

    def _load_single(self, state: dict[str, Any]) -> None:
        """A state saved before entries per worker: the whole loader state of each rank under
        its ``rank_*`` key (with its file fingerprints, or alone before those)."""
        key = _dcp_entries.rank_key(self.loader.rank)
        try:
            raw = state[key]
        except KeyError:
            raise ValueError(
                f"the checkpoint has no loader state for {key}; it was saved by an earlier "
                "version with another number of ranks, which restores on its own topology only"
            ) from None
        payload = _unpickled(raw)
        if "loader" not in payload:  # saved before fingerprints: the loader state alone
            payload = {"loader": payload, "file_fingerprints": None}
        loader = self.loader
        check_share(
            payload["file_fingerprints"],
            _loader_datasets(loader),
            world_size=loader.world_size,
            allow_changed_files=self.allow_changed_files,
            where=f"the loader state of {key} in the DCP checkpoint",
        )
        loader.load_state_dict(payload["loader"])


def _pickled(obj: Any) -> io.BytesIO:
    return io.BytesIO(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _unpickled(raw: Any) -> Any:
    data = raw.getvalue() if isinstance(raw, io.BytesIO) else bytes(raw)
    return pickle.loads(data)


def _merged_shares(shares: Iterator[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rank shares of file fingerprints (``{dataset: {file: fingerprint}}``) as one."""
    out: dict[str, dict[str, Any]] = {}
    for share in shares:
        for name, files in share.items():
            out.setdefault(name, {}).update(files)
    return out


_config_by_loader: weakref.WeakKeyDictionary[
    TokenLoader, tuple[dict[str, DatasetIndex], dict[str, Any]]
] = weakref.WeakKeyDictionary()


def _loader_config(loader: TokenLoader) -> tuple[dict[str, DatasetIndex], dict[str, Any]]:
    """The datasets ``loader``'s pipeline reads, by name, and its summary as configured (see
    :func:`_configured`): found once per loader (building its graph lists the data, a request
    per folder on an object store), not at every checkpoint. Its build function is fixed, so
    they do not change."""
    found = _config_by_loader.get(loader)
    if found is None:
        root, summary = _configured(loader)
        found = _config_by_loader[loader] = (_datasets_of(root), summary)
    return found


def _loader_datasets(loader: TokenLoader) -> dict[str, DatasetIndex]:
    """The datasets ``loader``'s pipeline reads, by name (see :func:`_loader_config`)."""
    return _loader_config(loader)[0]
