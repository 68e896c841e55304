"""File access for the reader: a dataset's files opened, read, prefetched and closed.

:class:`FileAccess` owns everything between a file number and its documents' data: the
dataset's :class:`~torchdata_ext.handlers.base.FileHandler`; opening a file in place (local),
from a :class:`~torchdata_ext.remote.ShardCache` (remote, downloaded whole) or by range requests
(remote Megatron pairs always; remote Arrow IPC, Parquet and token files with
``ShardCache(range_reads=True)``; token files from ``range_reads_above`` bytes); the cache holds that keep
the next files prefetched while the current one is read; a few more files kept open for
:meth:`FileAccess.fetch_document`, and local files the walk read last (a walk over logical
shards comes back to another shard's file at almost every block: reopening it and parsing its
index again each time was ~12% of the pipeline's time); closing and releasing all of them; and
the I/O counters.

It knows nothing of shards, cursors or epochs: the reader
(:class:`~torchdata_ext.nodes.reader.ShardReader`) decides which file and which documents come
next, and what to do with a file that cannot be read (raise, or skip it and record that in its
state). Handles and holds are never part of any state: they are rebuilt by opening again.

One file at a time is *current* (the one the walk reads)::

    open(file, upcoming) -> document count      close the current file, open `file`, hold the
                                                first `prefetch` remote files of `upcoming`
    get_many(doc_ids) / get(doc)                documents of the current file
    close(discard=...)                          close it (discard: drop its cached copy too);
                                                a local file read in place stays open among
                                                the last few files, and open() takes it back
    fetch_document(file, doc)                   any file (the current one or a small LRU)
    stop_prefetching() / close_all()            drop holds / close everything
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import numpy as np
from fsspec.core import split_protocol

from torchdata_ext.handlers.base import (
    DataFileError,
    DocData,
    FileHandler,
    get_handler,
    get_handler_class,
)
from torchdata_ext.remote import RemoteError, ShardCache, is_remote, with_retries
from torchdata_ext.sources.index import DatasetIndex

__all__ = ["CacheSetting", "FileAccess", "make_cache"]

logger = logging.getLogger(__name__)

CacheSetting: TypeAlias = ShardCache | str | os.PathLike[str] | bool | None
"""What a reader's ``cache`` argument may be (see :func:`make_cache`)."""

# files kept open after use: by fetch_document (rebuilding buffers on restore), and local files
# the walk read last (it comes back to the file of another shard at almost every block)
_FETCH_CACHE_FILES = 8
# side files a format reads next to a data file, fetched into the cache with it
_COMPANIONS = {"flat": (".offsets.npy",), "npy": (".offsets.npy",)}
_RANGE_FORMATS = ("arrow", "parquet")
_NOTHING_OPEN = "no file is open: call open(file, upcoming) first"


class FileAccess:
    """Open, read and close one dataset's files, with prefetching of the next ones.

    Args:
        dataset: the dataset whose files are read (by file number, ``dataset.files[i]``).
        cache: how remote files are read; see :func:`make_cache`.
        prefetch: how many of the upcoming remote files passed to :meth:`open` are held as
            prefetched (downloaded in the background); 0 turns prefetching off.

    One per reader, not thread-safe. Picklable before anything is opened (as a reader is when
    it is sent to a worker process).
    """

    def __init__(self, dataset: DatasetIndex, cache: CacheSetting, prefetch: int) -> None:
        self.dataset = dataset
        self.cache = make_cache(cache, dataset)
        self.prefetch = prefetch
        self._handler: FileHandler | None = None
        self._local_handler: FileHandler | None = None
        self._companions = _COMPANIONS.get(dataset.file_type, ())
        self._current: tuple[int, Any] | None = None
        self._fetch_cache: dict[int, Any] = {}
        self._stamps: dict[int, tuple[int, int, int]] = {}  # open local files as opened (_stamp)
        self._prefetching: list[str] = []  # URLs held prefetched in the cache
        self._sizes: dict[str, int] | None = None  # listed sizes by URL (_listed_size)
        self._io = {"files_opened": 0, "open_seconds": 0.0}

    # -- the current file ----------------------------------------------------------------------
    @property
    def current_file(self) -> int | None:
        """The number of the file :meth:`open` opened last (None once closed)."""
        return None if self._current is None else self._current[0]

    def open(self, file: int, upcoming: Iterable[int]) -> int:
        """Make file number ``file`` the current file, and hold the next files prefetched.

        The previous current file is closed. Of ``upcoming`` (the file numbers the caller will
        open next, in order; repeats allowed; read lazily, and only when prefetching applies),
        the first :attr:`prefetch` distinct remote files other than ``file`` are held as
        prefetched, and holds on files no longer among them are dropped. When nothing fetches
        ``file`` yet, it is fetched first and the prefetches start once it is open (so they do
        not slow it down).

        Returns:
            The file's number of documents, as its handler counts them.

        Raises:
            RemoteError: the storage failed (an outage or an access problem, not a bad file).
            DataFileError: the file cannot be read (a cached copy of it is discarded, so the
                next attempt fetches it again); other exceptions of the handler likewise mean
                the file cannot be read. Nothing is left open.
        """
        self.close()
        url = self.dataset.files[file]
        kept = self._fetch_cache.pop(file, None) if self._in_place(file) else None
        if kept is not None:
            if self._stamps.get(file) == self._stamp(file):  # a local file read a moment ago,
                self._current = (file, kept)  # unchanged: its handle (and index) as it was
                return self.handler().length(kept)
            self._close_handle(file, kept)  # replaced or rewritten since: read it anew
        try:
            handle = self._open_prefetching(file, self._prefetch_urls(file, upcoming))
        except DataFileError:
            self._discard(url)
            raise
        try:
            n = self.handler().length(handle)
        except BaseException:
            self._close_handle(file, handle)
            raise
        self._current = (file, handle)
        return n

    def get_many(self, doc_ids: np.ndarray) -> Sequence[DocData]:
        """Documents ``doc_ids`` of the current file, as its handler reads them."""
        if self._current is None or self._handler is None:  # (no extra call: the hot path)
            raise RuntimeError(_NOTHING_OPEN)
        return self._handler.get_many(self._current[1], doc_ids)

    def get(self, doc: int) -> DocData:
        """Document ``doc`` of the current file, as its handler reads it."""
        if self._current is None or self._handler is None:
            raise RuntimeError(_NOTHING_OPEN)
        return self._handler.get(self._current[1], doc)

    def close(self, *, discard: bool = False) -> None:
        """Close the current file, if any; ``discard=True`` also drops its cached copy (so it
        is fetched again next time)."""
        if self._current is not None:
            file, handle = self._current
            if not discard and self._in_place(file):  # kept open: the walk comes back to it
                self._keep(file, handle)
                # the pages it read (and the kernel's fault-around neighbours: ~64 KiB per
                # document read) leave this process's resident set; kept open, the 12 files of
                # the benchmark held +0.35 GB after 1,000 batches (they stay in the page cache)
                self.handler().release_pages(handle)
            else:
                self._close_handle(file, handle)
                if discard:
                    self._discard(self.dataset.files[file])
        self._current = None

    def _in_place(self, file: int) -> bool:
        """Whether file number ``file`` is a local file read in place (no cache, no download):
        keeping its handle open holds nothing but the handle."""
        url = self.dataset.files[file]
        return not is_remote(url) and (self.cache is None or not self.cache.is_cached(url))

    def _stamp(self, file: int) -> tuple[int, int, int]:
        """Local file number ``file`` as the filesystem has it now (inode, size, mtime in ns):
        a handle kept open is taken back only while this is unchanged, so a file replaced or
        rewritten meanwhile is read anew, never served from the old mapping."""
        try:
            st = os.stat(_local_path(self.dataset.files[file]))
        except OSError:
            return (-1, -1, -1)  # gone: opening it again reports the error
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _keep(self, file: int, handle: Any) -> None:
        """Keep ``handle`` open among the last files read (least recently used closed first)."""
        self._fetch_cache.pop(file, None)
        self._fetch_cache[file] = handle  # most recently used last
        while len(self._fetch_cache) > _FETCH_CACHE_FILES:
            old = next(iter(self._fetch_cache))
            self._close_handle(old, self._fetch_cache.pop(old))

    # -- any file ------------------------------------------------------------------------------
    def fetch_document(self, file: int, doc: int) -> DocData:
        """Document ``doc`` of file number ``file``, as its handler reads it.

        Read from the current file when that is ``file``; else from one of the last few files
        opened this way (kept open, least recently used closed first).
        """
        if self._current is not None and self._current[0] == file:
            return self.handler().get(self._current[1], doc)
        handle = self._fetch_cache.get(file)
        if handle is None:
            handle = self._open_handle(file)
        self._keep(file, handle)
        return self.handler().get(handle, doc)

    def handler(self) -> FileHandler:
        """The dataset's file handler (built on first use)."""
        if self._handler is None:
            self._handler = self.dataset.handler()
        return self._handler

    # -- holds, closing, counters -----------------------------------------------------------------
    @property
    def prefetching(self) -> list[str]:
        """The URLs held as prefetched in the cache (a copy)."""
        return list(self._prefetching)

    def stop_prefetching(self) -> None:
        """Drop every prefetch hold (the cache may then evict those files)."""
        self._hold_prefetched([])

    def close_all(self) -> None:
        """Close every open file and drop every hold on cached files. Usable again after."""
        self.close()
        self.stop_prefetching()
        for file in list(self._fetch_cache):
            self._close_handle(file, self._fetch_cache.pop(file))

    def io_stats(self) -> dict[str, float]:
        """``files_opened``, ``open_seconds`` (time spent opening files, waits for downloads
        included), then the cache's :meth:`~torchdata_ext.remote.ShardCache.stats`; without a
        cache, ``wait_seconds`` is ``open_seconds`` (files are read when opened)."""
        out: dict[str, float] = dict(self._io)
        if self.cache is not None:
            out.update(self.cache.stats())
        else:  # files are read when opened: opening is the wait
            out["wait_seconds"] = out["open_seconds"]
        return out

    # -- opening: local, remote through the cache, or remote by range requests -----------------
    def _all_by_range(self) -> bool:
        """Whether every remote file of the dataset is read by range, whatever its size."""
        cache = self.cache
        if cache is None:
            return False
        cls = get_handler_class(self.dataset.file_type)
        if cls.range_reads_always:
            return True
        ranged = self.dataset.file_type in _RANGE_FORMATS or (
            cls.open_ranged is not FileHandler.open_ranged
        )
        return cache.range_reads and ranged

    def _range_reads(self, url: str) -> bool:
        """Whether remote file ``url`` is read with range requests (nothing to prefetch):
        always for formats that say so (``range_reads_always``: Megatron); with
        ``ShardCache(range_reads=True)`` for Arrow IPC, Parquet and the formats that implement
        ``open_ranged``; for those too when the file is at least the cache's
        ``range_reads_above`` bytes."""
        cache = self.cache
        if cache is None:
            return False
        if self._all_by_range():
            return True
        cls = get_handler_class(self.dataset.file_type)
        if self.dataset.file_type in _RANGE_FORMATS or cls.open_ranged is FileHandler.open_ranged:
            return False
        size = self._listed_size(url)
        above = cache.range_reads_above
        return above is not None and size is not None and size >= above

    def _open_handle(self, file: int) -> Any:
        """Open file number ``file``: in place, from the cache, or by range requests."""
        url = self.dataset.files[file]
        handler = self.handler()
        so = self.dataset.storage_options
        t0 = time.perf_counter()
        try:
            if self.cache is None or not self.cache.is_cached(url):
                if not is_remote(url):  # in place: stamped, to be taken back while unchanged
                    handle = handler.open(url)
                    self._stamps[file] = self._stamp(file)
                    return handle
                return with_retries(lambda: handler.open(url), url, what="open")
            if self._range_reads(url):
                if self.dataset.file_type in _RANGE_FORMATS:
                    handle = _open_range(handler, self.cache, url, so, self._listed_size(url))
                else:
                    handle = self._open_ranged(handler, url)
                if handle is not None:
                    return handle
            local = self.cache.acquire(url, so, self._companions, self._listed_size(url))
            if self._local_handler is None:  # the remote storage_options mean nothing locally
                self._local_handler = get_handler(
                    self.dataset.file_type, **self.dataset.handler_options
                )
            try:
                return self._local_handler.open(local)
            except DataFileError as exc:
                self.cache.release(url, so)
                message = str(exc).removeprefix(f"{local}: ")
                raise DataFileError(url, f"{message} (read from the cached copy {local})") from exc
            except BaseException:
                self.cache.release(url, so)
                raise
        except FileNotFoundError as exc:
            raise DataFileError(
                url,
                f"not found ({exc}); it was listed when the dataset index was built: check that "
                "nothing deleted it, or rebuild the index",
            ) from exc
        finally:
            self._io["files_opened"] += 1
            self._io["open_seconds"] += time.perf_counter() - t0

    def _open_ranged(self, handler: FileHandler, url: str) -> Any:
        """Open ``url`` with the handler's own range reads through the cache's range files
        (retries, counters); None when the handler cannot (the file is downloaded instead)."""
        cache = self.cache
        if cache is None:  # (only called with range reads, which need a cache)
            return None
        so = self.dataset.storage_options
        size = self._listed_size(url)
        handle = handler.open_ranged(
            url, lambda u: cache.open_range(u, so, size if u == url else None)
        )
        if handle is not None:
            handle._range_read = True  # nothing of the cache to release when closed
        return handle

    def _open_prefetching(self, file: int, upcoming: list[str]) -> Any:
        """Open ``file`` and hold ``upcoming`` as prefetched, in the order :meth:`open` says."""
        url = self.dataset.files[file]
        cache = self.cache
        so = self.dataset.storage_options
        if cache is not None and cache.is_cached(url) and not cache.is_ready(url, so):
            try:
                return self._open_handle(file)
            finally:
                self._release(self._hold_prefetched(upcoming, current=url))
        later = self._hold_prefetched(upcoming, current=url)
        try:
            return self._open_handle(file)
        finally:  # the current file's prefetch hold, kept until it is open
            self._release(later)

    def _prefetch_urls(self, file: int, upcoming: Iterable[int]) -> list[str]:
        """URLs of the first :attr:`prefetch` distinct cached files of ``upcoming`` that are
        not ``file``; none when nothing is prefetched (``upcoming`` is then not read)."""
        n = self.prefetch
        cache = self.cache
        if n == 0 or cache is None or self._all_by_range():
            return []
        out: list[str] = []
        seen = {file}
        for other in upcoming:
            if other not in seen:
                seen.add(other)
                url = self.dataset.files[other]
                if cache.is_cached(url) and not self._range_reads(url):
                    out.append(url)
                    if len(out) >= n:
                        break
        return out

    def _discard(self, url: str) -> None:
        if self.cache is not None and self.cache.is_cached(url):
            self.cache.discard(url, self.dataset.storage_options)

    def _close_handle(self, file: int, handle: Any) -> None:
        self.handler().close(handle)
        self._stamps.pop(file, None)  # one per open local file, no more
        url = self.dataset.files[file]
        cache = self.cache
        if cache is not None and cache.is_cached(url) and not getattr(handle, "_range_read", 0):
            cache.release(url, self.dataset.storage_options)

    def _listed_size(self, url: str) -> int | None:
        """The size of ``url`` in bytes as the dataset index lists it (None, or negative, when
        it lists none: an index made by hand, or a store that gives no sizes): what spares a
        download or a range-read open its HEAD."""
        sizes = self._sizes
        if sizes is None:
            stats = self.dataset.file_stats
            # a negative size (none listed) the cache ignores (Entry.of, open_range)
            sizes = self._sizes = (
                {u: int(st[0]) for u, st in zip(self.dataset.files, stats)}
                if len(stats) == len(self.dataset.files)
                else {}
            )
        return sizes.get(url)

    def _hold_prefetched(self, urls: list[str], current: str | None = None) -> list[str]:
        """Hold exactly ``urls`` as prefetched in the cache (starting downloads of new ones).

        Returns the prefetch holds on ``current`` (the file about to be opened) that the caller
        releases once it is open, so the file cannot be evicted in between.
        """
        if self.cache is None or (not urls and not self._prefetching):
            return []
        so = self.dataset.storage_options
        held = set(self._prefetching)
        for url in urls:
            if url not in held:
                self.cache.prefetch(url, so, self._companions, self._listed_size(url))
        keep = set(urls)
        later = []
        for url in self._prefetching:
            if url not in keep:
                if url == current:
                    later.append(url)
                else:
                    self.cache.release(url, so)
        self._prefetching = list(urls)
        return later

    def _release(self, urls: list[str]) -> None:
        if self.cache is not None:
            for url in urls:
                self.cache.release(url, self.dataset.storage_options)


def _local_path(url: str) -> str:
    """The filesystem path of a local URL (a path, or ``file://`` and a path)."""
    return split_protocol(url)[1]


def make_cache(cache: CacheSetting, dataset: DatasetIndex) -> ShardCache | None:
    """The :class:`~torchdata_ext.remote.ShardCache` a reader of ``dataset`` uses, if any.

    Args:
        cache: a ``ShardCache`` (used as is; share one between readers); a folder path (a
            cache there); None or True (a cache in the default folder, when ``dataset`` has
            remote files); False (no cache: each remote file is read into memory when opened,
            with retries).
        dataset: the dataset to read. Local files are always read in place.
    """
    if isinstance(cache, ShardCache):
        return cache
    if cache is False:
        return None
    if cache is None or cache is True:
        if not any(is_remote(f) for f in dataset.files):
            return None
        return ShardCache(storage_options=dataset.storage_options)
    return ShardCache(cache, storage_options=dataset.storage_options)


def _open_range(
    handler: FileHandler, cache: ShardCache, url: str, so: dict[str, Any], size: int | None
) -> Any:
    """Open an Arrow IPC file (one document per record batch) or a Parquet file with range
    requests; None when the file is not of that kind (it is then downloaded instead).
    ``size``: as the dataset index lists it (spares a HEAD; see :meth:`ShardCache.open_range`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchdata_ext.handlers.arrow import ArrowReader, column_kind
    from torchdata_ext.handlers.parquet import ParquetReader

    col = handler.col_name
    source = pa.PythonFile(cache.open_range(url, so, size), mode="r")
    reader: Any = None
    try:
        if handler.name == "arrow":
            fr = pa.ipc.open_file(source)
            index, kind = column_kind(url, fr.schema, col, "Arrow")
            if kind == "int":  # other layouts read every batch on open: download instead
                reader = ArrowReader(
                    url, col, index, fr.schema, "file", "batch", "tokens", file_reader=fr
                )
        elif handler.name == "parquet":
            pf = pq.ParquetFile(source)
            _, kind = column_kind(url, pf.schema_arrow, col, "Parquet")
            if kind != "int":
                reader = ParquetReader(
                    url,
                    col,
                    pf,
                    "text" if kind == "text" else "tokens",
                    getattr(handler, "max_cached_row_groups", None),
                )
    except (pa.ArrowException, OSError, DataFileError) as exc:
        if isinstance(exc, RemoteError):
            raise
        logger.debug("range reads do not fit %s (%s); downloading it", url, exc)
        reader = None
    if reader is not None:
        reader._range_read = True
    return reader
