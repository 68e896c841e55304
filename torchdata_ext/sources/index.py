"""Dataset index: a dataset's files in a fixed order with their document and token counts.

Counting documents means opening every file (a download each on an object store), so counts are
read from where they were written before:

* a ``meta`` folder in the data folder or its parent, holding ``*counts*.csv`` files with rows
  ``dataset/filename,documents,tokens`` (IBM Bamba's layout). A row's path is relative to the
  folder holding ``meta``; a path with a leading slash (``/web/part-00000.arrow``, as
  fms-fsdp's tooling writes them), an absolute path or a URL matches the file whose path, from
  that folder on, it ends with. ``torchdata-ext prepare`` writes ``meta/torchdata_ext_counts.csv``
  there for its output, with an extra ``bytes`` column so a file that changed size since it was
  counted is counted again rather than trusted;
* the counts the index computed itself, kept in the local cache folder (``counts/`` in
  ``$TORCHDATA_EXT_CACHE_DIR``, else in ``<tempdir>/torchdata_ext_cache_<uid>``; one CSV per
  data folder URL), each with the file's size and version (mtime, or ETag on object stores) so
  a changed file is counted again.

The index never writes into a folder it reads unless asked to (``write_counts="data"``).

Reading the counts files and the counts cache is :mod:`torchdata_ext.sources.counts`; this
module lists the files, decides which counts to trust, counts the rest and writes them. Per-file
fingerprints live in :mod:`torchdata_ext.sources.fingerprint`; the index only keeps the sizes
and versions it listed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import numpy as np

from torchdata_ext.handlers.base import (
    DataFileError,
    FileHandler,
    format_for_url,
    get_handler,
    get_handler_class,
    handler_accepts,
    registered_formats,
)
from torchdata_ext.handlers.mds import drop_mds_side_files
from torchdata_ext.handlers.numpy_tokens import OFFSETS_SUFFIX
from torchdata_ext.progress import Progress
from torchdata_ext.remote import (
    RemoteError,
    check_access,
    with_retries,
    write_bytes_atomic,
)
from torchdata_ext.remote.urls import expand_urls, filesystem, storage_options_of
from torchdata_ext.sources.counts import (
    CACHE_HEADER,
    COUNTS_FILE,
    HEADER,
    Counts,
    cache_path,
    csv_text,
    read_cached,
    read_counts,
)
from torchdata_ext.sources.fingerprint import Stat, file_fingerprints, file_stat

__all__ = ["COUNTS_FILE", "DatasetIndex", "list_data_files", "read_data_sources"]

logger = logging.getLogger(__name__)


def read_data_sources(url: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """The file URLs listed in a Bolmo-style ``data_sources.txt`` (one per line, ``#`` comments).

    Relative entries are taken relative to the folder holding the list.
    """
    fs, path = filesystem(url, storage_options)
    text = with_retries(lambda: fs.cat_file(path), url, what="read").decode()
    lines = [ln.strip() for ln in text.splitlines()]
    base = url.rsplit("/", 1)[0] if "/" in url else "."
    out = []
    for ln in lines:
        if not ln or ln.startswith("#"):
            continue
        if "://" in ln or ln.startswith("/"):
            out.append(ln)
        else:
            out.append(posixpath.join(base, ln))
    if not out:
        raise ValueError(f"{url}: the data sources list names no files; add one URL per line")
    return out


@dataclass(frozen=True)
class DatasetIndex:
    """The files of one (sub-)dataset, sorted, with per-file document and token counts.

    Build one with :meth:`build`. Attributes:
        name: the dataset name (used in outputs and state keys).
        files: file URLs in their fixed (sorted) order.
        doc_counts: documents per file (``int64``).
        token_counts: tokens per file, or -1 where unknown (text formats).
        file_type: the registered format name used for every file.
        handler_options: keyword arguments for the handler (``col_name``, ``eos_token``, ...).
        storage_options: fsspec keyword arguments.
        file_stats: per file ``(size in bytes, version)`` as listed when the index was built
            (see :func:`torchdata_ext.sources.fingerprint.file_stat`); empty when the index was built
            by hand (then asked again when needed).
        side_files: small files next to the data read once with the index (the prepared
            metadata), by URL, None for one known to be absent: read from here instead of
            asking the store again in every worker (see :mod:`torchdata_ext.sources.index_file`).
        listed_at: when :attr:`file_stats` were listed (``time.time()``; 0: not known, e.g.
            read from an index file): a check of the data files against a checkpoint asks
            again for the stats of a listing older than the check
            (:func:`torchdata_ext.sources.fingerprint.current_fingerprints`).
    """

    name: str
    files: tuple[str, ...]
    doc_counts: np.ndarray
    token_counts: np.ndarray
    file_type: str
    handler_options: dict[str, Any] = field(default_factory=dict)
    storage_options: dict[str, Any] = field(default_factory=dict)
    file_stats: tuple[Stat, ...] = field(default=(), repr=False, compare=False)
    side_files: Mapping[str, bytes | None] = field(default_factory=dict, repr=False, compare=False)
    listed_at: float = field(default=0.0, repr=False, compare=False)

    @property
    def total_docs(self) -> int:
        return int(self.doc_counts.sum())

    @property
    def total_tokens(self) -> int:
        """Total tokens, or -1 when some file's token count is unknown."""
        return -1 if (self.token_counts < 0).any() else int(self.token_counts.sum())

    @property
    def root(self) -> str:
        """The folder holding all the files (where ``meta/`` is looked for)."""
        return _common_dir(self.files)

    def handler(self) -> FileHandler:
        """A new handler for this dataset's files."""
        return get_handler(
            self.file_type, storage_options=self.storage_options, **self.handler_options
        )

    def doc_lengths(self, *, read_documents: bool = False) -> np.ndarray | None:
        """Every document's length, files in order (``int64``, ``total_docs`` values): tokens
        as stored in the files (before any ``strip_tokens``), from each file's metadata
        (:meth:`FileHandler.doc_lengths <torchdata_ext.handlers.base.FileHandler.doc_lengths>`:
        Arrow footers, ``.npy`` headers, offset indexes), so no document is read.

        Args:
            read_documents: where a file has no length metadata (text formats), read its
                documents and measure them (characters for text); False returns None then.
        """
        handler = self.handler()
        out = []
        for url in self.files:
            reader = with_retries(partial(handler.open, url), url, what="open")
            try:
                lengths = handler.doc_lengths(reader)
                if lengths is None or handler.produces_for(reader) == "text":
                    if not read_documents:
                        return None
                    n = handler.length(reader)
                    lengths = np.array([len(handler.get(reader, i)) for i in range(n)], np.int64)
                out.append(np.asarray(lengths, dtype=np.int64))
            finally:
                handler.close(reader)
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def fingerprint(self) -> str:
        """A short hash of file names (relative to their common folder) and document counts.

        Two indexes of the same data give the same fingerprint wherever the data is mounted,
        so a checkpoint can be checked against the data it is restored into.
        """
        h = hashlib.sha256()
        for rel, n in zip(self.file_names(), self.doc_counts.tolist()):
            h.update(f"{rel}\0{n}\n".encode())
        return h.hexdigest()[:16]

    def file_names(self) -> list[str]:
        """The files' names relative to their common folder (the same wherever the data is
        mounted), in :attr:`files` order."""
        return _relative_names(self.files)

    def file_fingerprints(self, select: Sequence[int] | None = None) -> dict[str, dict[str, Any]]:
        """Per file, a cheap fingerprint that changes when the file is rewritten: size, version
        (mtime, ETag...) and the sha256 of its first and last 64 KiB
        (:func:`torchdata_ext.sources.fingerprint.file_fingerprint`).

        Computed on first use (two range reads per file, 16 files at a time) and kept for the
        rest of the process while a file's size and version stay the same.

        Args:
            select: file numbers (positions in :attr:`files`) to fingerprint; default all.

        Returns:
            ``{name relative to the common folder: {"size", "version", "sha256"}}``, the form
            :func:`torchdata_ext.sources.fingerprint.compare` takes. Empty for an in-memory dataset
            (:meth:`from_documents`).
        """
        if self.file_type == "memory":  # documents held by this process: no file can change
            return {}
        which = range(len(self.files)) if select is None else [int(i) for i in select]
        names = self.file_names()
        stats = [self.file_stats[i] for i in which] if self.file_stats else None
        fps = file_fingerprints([self.files[i] for i in which], self.storage_options, stats=stats)
        return {names[i]: fp for i, fp in zip(which, fps)}

    @classmethod
    def build(
        cls,
        urls: str | os.PathLike[str] | Sequence[str],
        *,
        name: str | None = None,
        file_type: str | None = None,
        col_name: str | None = None,
        eos_token: int | None = None,
        storage_options: dict[str, Any] | None = None,
        handler_options: dict[str, Any] | None = None,
        counts: str | None = None,
        write_counts: Literal["cache", "data"] | bool = "cache",
    ) -> DatasetIndex:
        """List a dataset's files and count their documents.

        Args:
            urls: a folder, a file, a glob or brace pattern, a ``data_sources.txt`` list, or a
                list of these; fsspec URLs.
            name: the dataset name; defaults to the last component of the common folder.
            file_type: a registered format name (``"arrow"``, ``"parquet"``, ``"npy"``,
                ``"ceped"``, ``"flat"``, ``"jsonl"``, ...); default: chosen by file suffix.
            col_name: the token or text field, passed to the handler.
            eos_token: the token id that ends every document, passed to the formats that split
                token streams on it (``"flat"``, ``"npy"``: whether ``file_type`` names them or
                the files' suffix chose them) and not to the others (Arrow, Parquet, ...), so
                one value serves datasets of any format. ``handler_options["eos_token"]`` wins.
            storage_options: fsspec keyword arguments (credentials, endpoint, ...).
            handler_options: further handler arguments (e.g. ``{"eos_token": 0}`` for flat
                token files).
            counts: URL of a counts CSV to read (default: look for ``meta/*counts*.csv`` in the
                data folder and its parent).
            write_counts: where the counts of files that had to be opened are kept for the next
                build: ``"cache"`` (default) in the local cache folder, nothing written into the
                data folder; ``"data"`` (or True) in ``meta/torchdata_ext_counts.csv`` in the
                data folder, as ``prepare`` does for its output; False nowhere. Failures to
                write are logged, not raised.

        Raises:
            FileNotFoundError: no data file matches ``urls``.
            ValueError: mixed formats without ``file_type``, or an unknown suffix.
            DataFileError: a file cannot be read.
        """
        if write_counts not in ("cache", "data", True, False):
            raise ValueError(f"{write_counts=} must be 'cache', 'data' or False")
        storage_options = storage_options_of(storage_options)
        handler_options = dict(handler_options or {})
        if col_name is not None:
            handler_options["col_name"] = col_name
        listed_at = time.time()
        files, file_type = list_data_files(urls, file_type, storage_options)
        if eos_token is not None and handler_accepts(get_handler_class(file_type), "eos_token"):
            handler_options.setdefault("eos_token", eos_token)
        root = _common_dir(files)
        if name is None:
            name = posixpath.basename(root.rstrip("/")) or "dataset"
        index = cls(
            name=name,
            files=tuple(files),
            doc_counts=np.zeros(len(files), np.int64),
            token_counts=np.full(len(files), -1, np.int64),
            file_type=file_type,
            handler_options=handler_options,
            storage_options=storage_options,
            file_stats=tuple(_file_stats(files, storage_options)),
            listed_at=listed_at,
        )
        index._fill_counts(root, counts, "data" if write_counts is True else write_counts)
        if index.total_docs == 0:
            raise ValueError(
                f"dataset {name!r} at {urls!r} has no documents in its {len(files)} file(s); "
                "check the path and col_name"
            )
        return index

    @classmethod
    def from_documents(
        cls,
        name: str,
        documents: Any,
        *,
        column: str | None = None,
        docs_per_file: int = 8192,
    ) -> DatasetIndex:
        """A dataset of documents held in memory (epochraft's ``from_sequence``).

        The documents are cut into virtual files of ``docs_per_file`` rows (format
        ``"memory"``, :class:`~torchdata_ext.handlers.memory.MemorySource`), so the reader's
        logical shards, walk, state, restore, rescale and held-out split work as for files.

        Args:
            name: the dataset name.
            documents: a sequence of 1-D integer token arrays (or lists of ints) or of ``str``
                (any other iterable, e.g. a generator, is read once into a list), a ``pyarrow`` Table / RecordBatch / list<int> or string Array /
                ChunkedArray, or a Hugging Face ``datasets.Dataset`` (read through its Arrow
                table, zero-copy; the ``hf`` extra).
            column: the token (list<int>) or text column of a table or dataset (default
                ``"tokens"``).
            docs_per_file: rows per virtual file. The fingerprint and the held-out split
                depend on it: keep it fixed for a run. Appending documents keeps the split of
                the ones already there.

        Raises:
            TypeError / ValueError: the documents are not one of these forms, are empty, or
                the column is missing or of another type.
        """
        from torchdata_ext.handlers.memory import MemorySource

        source = MemorySource(name, documents, column, docs_per_file)
        index = cls(
            name=str(name),
            files=source.files(),
            doc_counts=source.doc_counts(),
            token_counts=source.token_counts(),
            file_type="memory",
            handler_options={"source": source},
        )
        if index.total_docs == 0:
            raise ValueError(f"in-memory dataset {name!r} has no documents; pass at least one")
        return index

    # -- counting ---------------------------------------------------------------------------
    def _fill_counts(
        self, root: str, counts_url: str | None, write: Literal["cache", "data", False]
    ) -> None:
        stats = list(self.file_stats)  # build lists them: one per file
        sizes = [size for size, _ in stats]
        known = read_counts(root, counts_url, self.storage_options)
        cached = read_cached(root)
        missing: list[int] = []
        for i, f in enumerate(self.files):
            rec = known.get(f)
            if rec is None or (rec[2] >= 0 and sizes[i] >= 0 and rec[2] != sizes[i]):
                hit = cached.get(f)
                rec = hit[0] if hit is not None and sizes[i] >= 0 and hit[1] == stats[i] else None
            if rec is None:
                missing.append(i)
            else:
                self.doc_counts[i], self.token_counts[i] = rec[0], rec[1]
        if not missing:
            return
        handler = self.handler()
        with Progress(
            f"counting the documents of {self.name!r}", logger, total=len(missing), unit="files"
        ) as progress:
            for i in missing:
                url = self.files[i]
                reader = with_retries(partial(handler.open, url), url, what="open")
                try:
                    self.doc_counts[i] = handler.length(reader)
                    lengths = handler.doc_lengths(reader)
                    is_text = handler.produces_for(reader) == "text"
                    self.token_counts[i] = -1 if lengths is None or is_text else int(lengths.sum())
                finally:
                    handler.close(reader)
                progress.update()
        if write == "data" and counts_url is None:
            self._write_counts(root, sizes)
        elif write == "cache":
            self._write_cached(root, stats, cached)

    def _write_counts(self, root: str, sizes: list[int]) -> None:
        rel = _relative_names(self.files, root)
        text = csv_text(
            HEADER, zip(rel, self.doc_counts.tolist(), self.token_counts.tolist(), sizes)
        )
        url = posixpath.join(root, "meta", COUNTS_FILE)
        try:  # atomic, and a failed write (a full disk) leaves no temporary file
            write_bytes_atomic(url, text.encode(), self.storage_options)
        except Exception as exc:  # read-only data is normal on shared storage
            logger.warning("could not write document counts to %s (%s); continuing", url, exc)

    def _write_cached(
        self, root: str, stats: list[Stat], cached: dict[str, tuple[Counts, Stat]]
    ) -> None:
        """Keep this index's counts in the local cache (with every file's size and version),
        next to the cached counts of other files of the same folder."""
        rows = dict(cached)
        for url, n, t, st in zip(self.files, self.doc_counts, self.token_counts, stats):
            rows[url] = ((int(n), int(t), st[0]), st)
        text = csv_text(
            CACHE_HEADER, ((u, n, t, b, v) for u, ((n, t, b), (_, v)) in sorted(rows.items()))
        )
        path = cache_path(root)
        try:
            write_bytes_atomic(path, text.encode())
        except OSError as exc:
            logger.warning("could not keep document counts in %s (%s); continuing", path, exc)


def list_data_files(
    urls: str | os.PathLike[str] | Sequence[str],
    file_type: str | None,
    storage_options: dict[str, Any],
) -> tuple[list[str], str]:
    """The data files ``urls`` names, sorted, and their format: what :meth:`DatasetIndex.build`
    lists (side files such as offsets indexes and MDS ``index.json`` left out).

    Args:
        urls / file_type / storage_options: as for :meth:`DatasetIndex.build`.

    Raises:
        FileNotFoundError: no data file matches ``urls``.
        ValueError: mixed formats without ``file_type``, or an unknown format.
    """
    raw = [os.fspath(urls)] if isinstance(urls, (str, os.PathLike)) else list(urls)
    expanded: list[str] = []
    for u in raw:
        if u.endswith(".txt"):
            expanded.extend(read_data_sources(u, storage_options))
        else:
            expanded.append(u)
    suffixes = None
    if file_type == "memory":
        raise ValueError(
            "file_type='memory' is for documents held in memory: build the index with "
            "DatasetIndex.from_documents(name, documents)"
        )
    if file_type is not None:
        get_handler_class(file_type)  # unknown names fail here, naming the known ones
        suffixes = tuple(registered_formats().get(file_type, []))
        if file_type in ("flat", "ceped"):
            suffixes += (".npy",)
        if file_type == "megatron":  # a pair is listed by its .idx or its .bin
            suffixes += (".bin",)
        suffixes = suffixes or None
    else:
        suffixes = tuple(s for sfx in registered_formats().values() for s in sfx)
    listed_files: set[str] = set()
    try:
        with Progress(
            f"listing {', '.join(expanded)}", logger, total=len(expanded), unit="patterns"
        ) as progress:
            for u in expanded:
                found = with_retries(
                    partial(expand_urls, u, storage_options, suffixes=suffixes), u, what="list"
                )
                listed_files.update(found)
                progress.unit = f"patterns ({len(listed_files):,} files)"
                progress.update()
    except FileNotFoundError as exc:
        for u in expanded:  # say so if the bucket is missing or refuses these credentials
            check_access(u, storage_options)
        other = getattr(exc, "other_suffixes", None)
        if file_type is not None and other:
            formats = {s: n for n, sfx in registered_formats().items() for s in sfx}
            fits = sorted({formats[s] for s in other if s in formats})
            raise FileNotFoundError(
                f"{exc}, not {file_type} files: set file_type to their format"
                + (f" ({', '.join(map(repr, fits))})" if fits else "")
                + " or None to choose by suffix"
            ) from None
        raise
    files = sorted(listed_files)
    # an offsets sidecar next to its data file (``x.npy.offsets.npy``) is not data, nor is
    # an MDS folder's index.json (or a compressed copy of a listed raw MDS shard)
    files = drop_mds_side_files(files)
    listed = set(files)
    files = [
        f for f in files if not (f.endswith(OFFSETS_SUFFIX) and f[: -len(OFFSETS_SUFFIX)] in listed)
    ]
    if file_type in (None, "megatron"):  # a Megatron pair is one data file: listed by its .idx
        files = [f for f in files if not (f.endswith(".bin") and f[:-4] + ".idx" in listed)]
    if file_type is None:
        kinds = {format_for_url(f) for f in files}
        if len(kinds) > 1:
            raise ValueError(
                f"the files of dataset {urls!r} have several formats {sorted(kinds)}; "
                "pass file_type=... or point urls at one format"
            )
        file_type = kinds.pop()
    return files, file_type


def _common_dir(files: Sequence[str]) -> str:
    dirs = [f.rsplit("/", 1)[0] if "/" in f else "." for f in files]
    common = os.path.commonprefix(dirs)
    if not all(d == common or d.startswith(common.rstrip("/") + "/") for d in dirs):
        common = common.rsplit("/", 1)[0]
    return common


def _relative_names(files: Sequence[str], root: str | None = None) -> list[str]:
    root = _common_dir(files) if root is None else root
    prefix = root.rstrip("/") + "/"
    return [f[len(prefix) :] if f.startswith(prefix) else f for f in files]


def _file_stats(files: Sequence[str], storage_options: dict[str, Any]) -> list[Stat]:
    """Each listed file's size and version (``-1``/``""`` where its store does not say), from
    fsspec ``info`` (served from the listing on object stores: no request per file).

    Raises:
        DataFileError: a listed file cannot be stat'ed (removed or renamed since the listing,
            or not readable), naming it: the index would hold a file that cannot be read.
        RemoteError: the store cannot be reached or refuses access (after retries).
    """
    out: list[Stat] = []
    for f in files:
        try:
            out.append(file_stat(f, storage_options))
        except RemoteError:
            raise
        except OSError as exc:
            raise DataFileError(
                f,
                f"listed, but its size cannot be read ({type(exc).__name__}: {exc}); was it "
                "removed or renamed while the index was built? Build the index again",
            ) from exc
    return out
