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
(:class:`~torchdata_ext.checkpoint.dcp.DCPLoaderState`) records, per rank, that rank's share of
the fingerprints.

Restoring onto another number of ranks x workers (:func:`load_checkpoint`): each new worker
reads only the old workers' files it needs (the old owners of its logical shards) and
:mod:`torchdata_ext.checkpoint.rescale` plans its state from them (merged reader cursors of its shards,
in-flight data handed back, interleave token counters re-split), so the epoch goes on with
nothing repeated and nothing lost. The checks and the restore are those of a DCP checkpoint
(:class:`~torchdata_ext.checkpoint.dcp.DCPLoaderState`) too: one
:func:`~torchdata_ext.checkpoint.restore.restore_loader` in
:mod:`torchdata_ext.checkpoint.restore`; this module holds the folder's files alone.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import posixpath
from collections.abc import Callable, Iterator
from typing import Any

from torchdata_ext.checkpoint.dcp_entries import dcp_loader_call, is_dcp_checkpoint
from torchdata_ext.checkpoint.restore import CHECKPOINT_FORMAT, loader_config, restore_loader
from torchdata_ext.loader.token_loader import STATE_FORMAT, TokenLoader
from torchdata_ext.remote import remove_file, write_bytes_atomic
from torchdata_ext.remote.urls import filesystem, one_request, storage_options_of
from torchdata_ext.sources.fingerprint import (
    SAMPLE_BYTES,
    check_data_files,
    dataset_fingerprints,
    is_collective,
)
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.state.graph import graph_summary
from torchdata_ext.world import World

__all__ = [
    "CHECKPOINT_FORMAT",
    "checked_format",
    "is_checkpoint_folder",
    "load_checkpoint",
    "read_manifest",
    "read_worker_states",
    "save_checkpoint",
    "worker_states",
]

_MANIFEST = "manifest.json"
_CHECKSUMS = "sha256"  # the manifest's "checksums": the hash of every file of the checkpoint


# -- file I/O -----------------------------------------------------------------------------------
def _read(url: str, storage_options: dict[str, Any] | None) -> bytes:
    """The bytes of checkpoint file ``url`` (one GET on an object store, no HEAD); a missing
    file says the checkpoint is incomplete."""
    fs, path = filesystem(url, storage_options)
    try:
        return bytes(fs.cat_file(path, **one_request(fs)))
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


def loader_storage_options(loader: TokenLoader) -> dict[str, Any]:
    """The ``storage_options`` of the config ``loader`` was built from: what a checkpoint call
    given none uses (the options given once reach every URL of the run).

    Found in the loader's build function, ``functools.partial(build_pipeline, cfg)`` (or any
    ``functools.partial`` given a config): the config's ``storage_options``. None for a build
    function of another kind: pass ``storage_options=`` to the checkpoint call then.
    """
    cfg = loader.built_config()
    options = getattr(cfg, "storage_options", None)
    return dict(options) if isinstance(options, dict) else {}


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
        storage_options: fsspec options for ``url`` (default: the loader config's
            ``storage_options``, see :func:`loader_storage_options`).
    """
    storage_options = storage_options_of(storage_options, loader_storage_options(loader))
    state = loader.state_dict()
    # before anything in url changes: a failure here leaves an earlier checkpoint there intact
    configured = None
    data_files: dict[str, Any] = {}
    if loader.rank == 0 or is_collective(loader.world_size):
        configured = loader_config(loader)
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
        "step": state["step"],
        "skip_steps": state["skip_steps"],
        "weight_changes": state["weight_changes"],
        "weight_schedule": state["weight_schedule"],
        "skipped_documents": state["skipped_documents"],
        "mix_history": state["mix_history"],
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
            "step": state["step"],
            "skip_steps": state["skip_steps"],
            "weight_changes": state["weight_changes"],
            "weight_schedule": state["weight_schedule"],
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
        NotADirectoryError: ``url`` is a file.
        ValueError: a checkpoint format this version does not read, a corrupt manifest, or a
            ``torch.distributed.checkpoint`` (DCP) folder (named, with the call that loads it).
    """
    try:
        manifest = _read_json(posixpath.join(url, _MANIFEST), storage_options, checked=False)
    except (FileNotFoundError, NotADirectoryError):
        fs, path = filesystem(url, storage_options)
        if not fs.exists(path):
            raise FileNotFoundError(
                f"checkpoint folder {url} does not exist (so no {_MANIFEST}): check the "
                f"path{_beside(fs, path)}"
            ) from None
        if fs.isfile(path):
            raise NotADirectoryError(
                f"checkpoint {url} is a file, not a checkpoint folder: pass the folder that "
                "save_checkpoint or dcp.save wrote (a config file goes to config / --config)"
            ) from None
        if is_dcp_checkpoint(url, storage_options):
            raise ValueError(
                f"{url} is a torch.distributed.checkpoint (DCP) checkpoint, not a loader "
                "checkpoint folder of save_checkpoint: restore the loader from it with "
                f"{dcp_loader_call(url, storage_options)} (or DCPLoaderState(loader, "
                "checkpoint_id=...) inside your own dcp.load); audit_checkpoint and "
                "torchdata-ext audit read it as it is"
            ) from None
        if _holds_distcp(fs, path):
            raise FileNotFoundError(
                f"DCP checkpoint {url} has no .metadata (it holds .distcp data files): its save "
                "did not finish or the file was removed; restore from another checkpoint"
            ) from None
        raise FileNotFoundError(
            f"{url} has no {_MANIFEST}: not a loader checkpoint, or one whose save did not finish "
            "(a kill during save); restore from an earlier checkpoint"
        ) from None
    return checked_format(manifest, url)


def _holds_distcp(fs: Any, path: str) -> bool:
    """Whether folder ``path`` holds DCP data files (``*.distcp``)."""
    try:
        return any(str(p).endswith(".distcp") for p in fs.ls(path, detail=False))
    except OSError:
        return False


def checked_format(manifest: dict[str, Any], where: str) -> dict[str, Any]:
    """``manifest`` (of the checkpoint ``where``: a folder, or the loader state in a DCP
    checkpoint), refused when this version does not read its format."""
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{where}: checkpoint format {manifest.get('format')!r} is not supported "
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
    yield from worker_states(
        manifest,
        lambda r: _read_rank(url, r, storage_options, checked),
        lambda g, meta: _read_worker(url, g, meta, storage_options),
    )


def worker_states(
    manifest: dict[str, Any],
    rank_meta: Callable[[int], dict[str, Any]],
    worker: Callable[[int, dict[str, Any]], dict[str, Any]],
) -> Iterator[tuple[World, dict[str, Any], dict[str, Any]]]:
    """Every worker's ``(world, rank_meta, graph)`` of a checkpoint with ``manifest``, rank by
    rank, from ``rank_meta(r)`` (old rank ``r``'s entry) and ``worker(g, meta)`` (global worker
    ``g``'s graph state): what :func:`read_worker_states` yields, for any storage."""
    ranks, workers = int(manifest["world_size"]), int(manifest["num_workers"])
    for r in range(ranks):
        meta = rank_meta(r)
        for w in range(workers):
            yield World(r, ranks, w, workers), meta, worker(r * workers + w, meta)


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
        storage_options: fsspec options for ``url`` (default: the loader config's
            ``storage_options``, see :func:`loader_storage_options`).
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
    storage_options = storage_options_of(storage_options, loader_storage_options(loader))
    manifest = read_manifest(url, storage_options)
    checked = manifest.get("checksums") == _CHECKSUMS

    def check_files(
        datasets: dict[str, DatasetIndex], reads: dict[str, list[int]], listed_since: float
    ) -> None:
        check_data_files(
            manifest.get("file_fingerprints"),
            datasets,
            rank=loader.rank,
            world_size=loader.world_size,
            allow_changed_files=allow_changed_files,
            where=f"loader checkpoint {url}",
            reads=reads,
            listed_since=listed_since,
        )

    restore_loader(
        loader,
        manifest,
        f"checkpoint {url}",
        rank_meta=lambda r: _read_rank(url, r, storage_options, checked),
        worker=lambda g, meta: _read_worker(url, g, meta, storage_options),
        check_files=check_files,
        allow_weight_changes=allow_weight_changes,
        allow_new_datasets=allow_new_datasets,
    )
