"""Index files: a dataset's listing and counts in one object, so a rank starts without a LIST.

Building a :class:`~torchdata_ext.sources.index.DatasetIndex` lists the dataset's folder (a LIST request
per 1,000 files on S3), looks for counts files (two more LISTs and a GET each) and the prepared
metadata (a GET). Done by every rank and worker, a job's start costs ranks x workers x that,
against one prefix. An *index file*, ``<dataset folder>/meta/torchdata_ext_index.json``
(:data:`INDEX_FILE`), holds all of it: the files (relative to the folder), their document and
token counts, sizes and versions (ETag, mtime) and the handler options they were counted with.
``torchdata-ext prepare`` writes it with its output, and ``torchdata-ext index DATA_PATH``
(:func:`write_index_files`) for any data. The prepared metadata file is not copied into it
(it is read as it is now, one more GET, so deleting or rewriting it takes effect at once).

**Prepared data can move.** File names are recorded relative to the folder however the folder
was spelled (a relative path, a symlink), so a copy, an upload to an object store, a symlink or
a relative ``data_path`` reads the same index file. The index file also holds each file's
sampled sha256 (its first and last 64 KiB, as checkpoints record it): a local copy that did
not keep modification times (``cp -r``) is recognised by those bytes and read as it is, and on
an object store a checkpoint save takes the digests of objects listed with their recorded ETag
from it instead of reading every file (written from a local folder, an upload has new versions:
those files are read once per process). Index files
of earlier versions holding absolute names are read where those files are below the folder
(symlinks resolved), and refused with :class:`StaleIndexError` where the data has moved since.

**Stale index files are refused, never used.** Reading one costs one GET and no LIST; one
process of the job (rank 0, worker 0: :func:`load_index_file` with ``verify=True``) lists the
folder once and compares names, sizes and versions. A file added, removed, resized or rewritten
since the index was written raises :class:`StaleIndexError` naming the files; it is not rebuilt
on the fly, because the other ranks read the same index file without listing and must all see
the same files (one rank rebuilding alone would give ranks different shards). Write it again
with ``torchdata-ext index DATA_PATH`` (or delete it: the job then lists at every start).

An index file counted with other handler options than the config asks for (another
``file_type``, ``col_name`` or ``eos_token``) is not used (logged): the folder is listed and
counted as without one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from torchdata_ext.handlers.base import get_handler_class, handler_accepts
from torchdata_ext.remote import write_bytes_atomic
from torchdata_ext.remote.urls import filesystem, join, storage_options_of, unstrip
from torchdata_ext.sources.fingerprint import (
    compare,
    file_fingerprint,
    file_fingerprints,
    file_stat,
    known_digests,
    remember_digests,
)
from torchdata_ext.sources.index import DatasetIndex, list_data_files
from torchdata_ext.sources.prepared_meta import meta_url, read_side_file

__all__ = [
    "INDEX_FILE",
    "StaleIndexError",
    "index_file_url",
    "load_index_file",
    "shared_by_rank0",
    "shared_indexes",
    "with_side_files",
    "write_index_file",
    "write_index_files",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

INDEX_FILE = "torchdata_ext_index.json"
INDEX_VERSION = 1
_SHOWN = 10  # files named in a stale-index error

_COPIED_HINT = (
    ". Only modification times changed: if the folder was copied without keeping them "
    "(cp -r without -p), copy it with cp -a, rsync -a or shutil.copytree instead"
)
_verified: set[tuple[str, str]] = set()  # (index file URL, sha256 of its bytes) listed as fresh
_lock = threading.Lock()


class StaleIndexError(ValueError):
    """An index file no longer matches its folder's listing (files added, removed, resized or
    rewritten since it was written). The message names the files and the command that writes
    the index again."""


def index_file_url(folder: str) -> str:
    """The index file of the dataset in ``folder``."""
    return join(folder, "meta", INDEX_FILE)


def _canonical(folder: str, storage_options: dict[str, Any] | None) -> str:
    """``folder`` spelled as a listing spells its files: a local path absolute (``data/web``
    run from ``/job`` is ``/job/data/web``; a symlink is kept, not resolved), a remote one a
    full URL."""
    fs, path = filesystem(folder, storage_options)
    return unstrip(fs, path).rstrip("/") or "/"


def _under(url: str, folder: str) -> str | None:
    """``url``'s name relative to ``folder`` (both spelled as :func:`_canonical` does), or
    None when it is not below it. Local paths are also compared with symlinks resolved."""
    prefix = folder.rstrip("/") + "/"
    if url.startswith(prefix):
        return url[len(prefix) :]
    if url.startswith("/") and folder.startswith("/"):
        real, real_folder = os.path.realpath(url), os.path.realpath(folder)
        if real.startswith(real_folder.rstrip("/") + "/"):
            return real[len(real_folder.rstrip("/")) + 1 :]
    return None


def _relative(url: str, folder: str) -> str:
    """``url``'s name relative to ``folder``, or ``url`` itself when it is not below it."""
    rel = _under(url, folder)
    return url if rel is None else rel


def _recorded_name(name: str, folder: str, url: str) -> str:
    """A file name of the index file at ``url`` as a name relative to ``folder``: index files
    record relative names; those written by earlier versions may hold absolute ones, read
    where they are below ``folder`` (the data has not moved, or is reached by another spelling
    of the same folder).

    Raises:
        StaleIndexError: an absolute name outside ``folder`` (the data moved since the index
            file was written with absolute names).
    """
    if "://" not in name and not name.startswith("/"):
        return name
    rel = _under(name, folder)
    if rel is None:
        raise StaleIndexError(
            f"the index file {url} names the file {name}, which is not in {folder}: it was "
            "written (by an earlier version) with absolute paths, and the data has moved since. "
            f"Write it again with {_fix(folder)}, or delete it to list the folder at every start"
        )
    return rel


def _fix(folder: str) -> str:
    """The command that writes ``folder``'s index file again, for messages."""
    remote = "://" in folder and not folder.startswith("file://")
    if remote:
        return (
            f"`torchdata-ext index {folder} --storage-options JSON` (JSON: the config's "
            "storage_options as a JSON object; and the config's --file-type, --col-name, "
            "--eos-token)"
        )
    return f"`torchdata-ext index {folder}` (and the config's --file-type, --col-name, --eos-token)"


def with_side_files(index: DatasetIndex) -> DatasetIndex:
    """``index`` with its prepared metadata file read (or known absent) in ``side_files``, so
    the pipelines built from it do not ask the store for it again."""
    url = meta_url(index.root)
    if url in index.side_files:
        return index
    raw = read_side_file(url, index.storage_options)
    return dataclasses.replace(index, side_files={**index.side_files, url: raw})


def write_index_file(folder: str, index: DatasetIndex) -> str:
    """Write ``index`` as ``folder``'s index file, atomically; return its URL.

    Args:
        folder: the dataset folder the pipeline names (``data_path/<dataset>``).
        index: the dataset's index as :meth:`DatasetIndex.build` made it (with ``file_stats``).

    Raises:
        ValueError: ``index`` was built by hand or in memory (no sizes and versions to check
            it against later), or its handler options are not plain JSON values.
    """
    if not index.file_stats or index.file_type == "memory":
        raise ValueError(
            f"dataset {index.name!r}: only an index built from files by DatasetIndex.build "
            "(with their sizes and versions) can be written as an index file"
        )
    body = {
        "index_version": INDEX_VERSION,
        "name": index.name,
        "file_type": index.file_type,
        "handler_options": dict(index.handler_options),
        "files": _relative_files(folder, index),
        "documents": index.doc_counts.tolist(),
        "tokens": index.token_counts.tolist(),
        "sizes": [size for size, _ in index.file_stats],
        "versions": [version for _, version in index.file_stats],
    }
    # a local copy that loses modification times is recognised by these bytes, and on an object
    # store a save takes them instead of reading every file (remember_digests)
    fps = file_fingerprints(list(index.files), index.storage_options, stats=index.file_stats)
    body["sha256"] = [fp["sha256"] for fp in fps]
    try:
        data = json.dumps(body, sort_keys=True).encode()
    except TypeError as exc:
        raise ValueError(
            f"dataset {index.name!r}: handler options {index.handler_options!r} cannot be "
            f"written as JSON ({exc}); pass only plain values (col_name, eos_token)"
        ) from None
    url = index_file_url(folder)
    write_bytes_atomic(url, data, index.storage_options)
    return url


def _relative_files(folder: str, index: DatasetIndex) -> list[str]:
    """The index's files relative to ``folder``, as the index file records them.

    Raises:
        ValueError: a file is not below ``folder`` (its name would not survive a move).
    """
    root = _canonical(folder, index.storage_options)
    out = []
    for f in index.files:
        rel = _under(f, root)
        if rel is None:
            raise ValueError(
                f"dataset {index.name!r}: the file {f} is not in {folder}: an index file "
                "records its files relative to its folder; build the index from the folder "
                "itself (DatasetIndex.build(folder))"
            )
        out.append(rel)
    return out


def _options_key(file_type: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with the handler's defaults filled in, so absent and default compare equal."""
    params = inspect.signature(get_handler_class(file_type).__init__).parameters.values()
    defaults = {
        p.name: p.default
        for p in params
        if p.default is not p.empty and p.name not in ("self", "storage_options")
    }
    return {**defaults, **options}


def load_index_file(
    folder: str,
    *,
    name: str,
    file_type: str | None,
    col_name: str | None = None,
    eos_token: int | None = None,
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
) -> DatasetIndex | None:
    """The dataset in ``folder`` from its index file (one GET), or None when it has none, one
    counted with other options, or ``file_type`` is None (the format is found from the listed
    files): then build the index by listing, as without one.

    Args:
        folder: the dataset folder.
        name / file_type / col_name / eos_token / storage_options: as for
            :meth:`DatasetIndex.build` (``eos_token`` goes to the formats that take it).
        verify: list the folder once in this process and refuse a stale index file (the job's
            rank 0 does it; the other ranks trust it).

    Raises:
        StaleIndexError: ``verify`` and the listing differs from the index file.
        ValueError: the index file is not one this version reads.
    """
    storage_options = storage_options_of(storage_options)
    url = index_file_url(folder)
    if file_type is None:  # the format is found from the files: the listing decides it
        return None
    try:
        raw = read_side_file(url, storage_options)
    except NotADirectoryError:  # the data path is a file (a data_sources.txt list)
        return None
    if raw is None:
        return None
    try:
        body = json.loads(raw)
        version = body["index_version"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f"{url}: not a torchdata-ext index file; write it again with {_fix(folder)}, "
            "or delete it"
        ) from None
    if version != INDEX_VERSION:
        raise ValueError(
            f"{url}: index file version {version!r} is not supported (this version reads "
            f"{INDEX_VERSION}); write it again with {_fix(folder)}"
        )
    stored_type = body["file_type"]
    wanted: dict[str, Any] = {} if col_name is None else {"col_name": col_name}
    if eos_token is not None and handler_accepts(get_handler_class(stored_type), "eos_token"):
        wanted["eos_token"] = eos_token
    options = dict(body["handler_options"])
    if (file_type is not None and file_type != stored_type) or _options_key(
        stored_type, options
    ) != _options_key(stored_type, {**options, **wanted}):
        logger.info(
            "%s was counted as file_type=%r with %r, not as this config asks (file_type=%r, "
            "%r): listing %s instead",
            url, stored_type, options, file_type, wanted, folder,
        )  # fmt: skip
        return None
    root = _canonical(folder, storage_options)
    files = tuple(join(root, _recorded_name(f, root, url)) for f in body["files"])
    index = DatasetIndex(
        name=name,
        files=files,
        doc_counts=np.asarray(body["documents"], np.int64),
        token_counts=np.asarray(body["tokens"], np.int64),
        file_type=stored_type,
        handler_options={**options, **wanted},
        storage_options=storage_options,
        file_stats=tuple(zip((int(s) for s in body["sizes"]), body["versions"])),
    )
    if verify:
        _check_fresh(url, hashlib.sha256(raw).hexdigest(), folder, index, body.get("sha256"))
    if body.get("sha256") is not None:  # objects of a content version: a save need not read them
        remember_digests(
            files,
            [
                {"size": size, "version": version, "sha256": digest}
                for (size, version), digest in zip(index.file_stats, body["sha256"])
            ],
        )
    return index


def _check_fresh(
    url: str, digest: str, folder: str, index: DatasetIndex, sampled: Sequence[str] | None
) -> None:
    """List ``folder`` (once per process for these index bytes) and refuse the index file if
    the listing's names, sizes or versions differ from it. Files whose version alone differs
    are taken as they are when the index file holds their sampled sha256 (``sampled``, one per
    file) and their bytes still give it: a copy that did not keep modification times."""
    with _lock:
        if (url, digest) in _verified:
            return
    files, _ = list_data_files(folder, index.file_type, index.storage_options)
    root = _canonical(folder, index.storage_options)
    now = {
        _relative(f, root): {"size": size, "version": version, "sha256": ""}
        for f in files
        for size, version in [file_stat(f, index.storage_options)]
    }
    recorded = {
        _relative(f, root): {"size": size, "version": version, "sha256": ""}
        for f, (size, version) in zip(index.files, index.file_stats)
    }
    changes = compare(recorded, now)
    if changes and sampled is not None and all(c.what == ("version",) for c in changes):
        changes = _same_sampled_bytes(changes, root, index, sampled)
    if changes:
        shown = "; ".join(str(c) for c in changes[:_SHOWN])
        more = f"; and {len(changes) - _SHOWN} more" if len(changes) > _SHOWN else ""
        raise StaleIndexError(
            f"the index file {url} is stale: {len(changes)} file(s) of {folder} changed since "
            f"it was written: {shown}{more}. It is not rebuilt here (the other ranks read it "
            f"without listing and must see the same files): write it again before starting "
            f"the job with {_fix(folder)}, or delete it to list the folder at every start"
            + _COPIED_HINT
            * all(c.what == ("version",) for c in changes)
        )
    with _lock:
        _verified.add((url, digest))


def _same_sampled_bytes(
    changes: list[Any], root: str, index: DatasetIndex, sampled: Sequence[str]
) -> list[Any]:
    """Of ``changes`` (files whose version alone differs), those whose sampled sha256 differs
    from the index file's too (as :func:`compare` reports them); logs the ones taken as copies."""
    recorded = {_relative(f, root): d for f, d in zip(index.files, sampled)}
    left = []
    for c in changes:
        now = file_fingerprint(join(root, c.file), index.storage_options)["sha256"]
        old = {**c.recorded, "sha256": recorded.get(c.file, "")}
        left += compare({c.file: old}, {c.file: {**c.current, "sha256": now, "version": ""}})
    if len(left) < len(changes):
        logger.info(
            "%s: %d file(s) have other modification times than its index file records, and the "
            "same sampled bytes (a copy that did not keep them): read as they are",
            root, len(changes) - len(left),
        )  # fmt: skip
    return left


def shared_by_rank0(build: Callable[[], T], doing: str) -> T:
    """``build()`` on rank 0 of ``torch.distributed``, its result broadcast to every rank (a
    collective: every rank calls it). A failure on rank 0 reaches every rank: rank 0 raises
    its error, the others a ``RuntimeError`` naming it, and none waits."""
    import torch.distributed as dist

    payload: list[Any] = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            payload = [(build(), None)]
        except Exception as exc:  # raised below, once the other ranks know
            error = exc
            payload = [(None, f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(payload, src=0)
    if error is not None:
        try:
            raise error
        finally:  # the frame must not hold the error its traceback holds (a cycle)
            del error
    result, their_error = payload[0]
    if their_error is not None:
        raise RuntimeError(f"rank 0 could not {doing}: {their_error}")
    return result


def shared_indexes(
    build: Callable[[], dict[str, DatasetIndex]], doing: str
) -> dict[str, DatasetIndex]:
    """:func:`shared_by_rank0` of dataset indexes, with the sampled digests rank 0 holds for
    their files (its index files record them): every rank remembers them
    (:func:`~torchdata_ext.sources.fingerprint.remember_digests`), so no rank reads a data
    file at a save or restore over unchanged objects. A collective: every rank calls it."""

    def built() -> tuple[dict[str, DatasetIndex], list[dict[str, Any]]]:
        datasets = build()
        digests = [fp for ix in datasets.values() for fp in known_digests(ix.files, ix.file_stats)]
        return datasets, digests

    datasets, digests = shared_by_rank0(built, doing)
    remember_digests([fp["url"] for fp in digests], digests)
    return datasets


def write_index_files(
    data_path: str,
    datasets: Sequence[str] = (),
    *,
    file_type: str | None = "arrow",
    col_name: str = "tokens",
    eos_token: int | None = 0,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """List and count every dataset of ``data_path`` and write its index file (what
    ``torchdata-ext index`` runs); return the URLs written.

    Args:
        data_path: the folder holding one sub-folder per dataset (as ``PipelineConfig``).
        datasets: the sub-folder names; empty: ``data_path`` itself is one dataset.
        file_type / col_name / eos_token / storage_options: as in ``PipelineConfig``.
    """
    out = []
    names: list[str | None] = list(datasets) or [None]
    for name in names:
        folder = data_path if name is None else join(data_path, name)
        index = DatasetIndex.build(
            folder,
            name=name,
            file_type=file_type,
            col_name=col_name,
            eos_token=eos_token,
            storage_options=storage_options,
        )
        out.append(write_index_file(folder, index))
    return out
