"""The shared local shard cache: whole-file downloads, holds, background prefetch, counters.

:class:`ShardCache` downloads remote shard files into a local folder shared by every worker and
rank on the machine. A file is downloaded under a temporary name and renamed, so a partly
downloaded file is never read; a per-file ``flock`` lock makes sure two processes never download
the same file at once (the second waits and then finds the complete file); a size limit evicts
least-recently-used files that nobody holds. Downloads of the files a reader needs next run in a
small background thread pool (:meth:`ShardCache.prefetch`). Counters (:meth:`ShardCache.stats`)
say whether I/O is the bottleneck.

This module is what one process keeps: holds, prefetch threads, counters and the download. The
folder's layout, locks and eviction, shared by all processes, are in :mod:`.disk`. This module is
584 lines because :class:`ShardCache` is one ~470-line class whose parts all share one lock and
one per-process state (``_Runtime``); split further, that lock's protocol would be scattered.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from torchdata_ext.progress import Progress, fsspec_callback
from torchdata_ext.remote import disk
from torchdata_ext.remote.disk import Entry
from torchdata_ext.remote.files import default_cache_dir, is_remote, private_filesystem
from torchdata_ext.remote.process_state import CACHES
from torchdata_ext.remote.rangefile import RangeFile
from torchdata_ext.remote.retry import IncompleteDownload, RetryPolicy, with_retries
from torchdata_ext.remote.urls import storage_options_of

__all__ = ["ShardCache"]

logger = logging.getLogger(__name__)

_AUTO_FRACTION = 0.5  # max_bytes="auto": this share of the free disk space at first use


@dataclass
class _Slot:
    """This process's use of one cached file."""

    refs: int = 0  # holds by callers (prefetch and open)
    fd: int | None = None  # lock file descriptor holding a shared lock: file complete and kept
    future: Future | None = None  # a download in flight in this process


_STAT_KEYS = (
    "bytes_downloaded",
    "downloads",
    "prefetched",
    "cache_hits",
    "prefetch_waits",
    "misses",
    "wait_seconds",
    "download_seconds",
    "retries",
    "evictions",
    "evicted_bytes",
    "prefetch_skipped",
    "range_requests",
)


@dataclass
class _Runtime:
    """Per-process state of a :class:`ShardCache` (rebuilt after fork or unpickling)."""

    pid: int = field(default_factory=os.getpid)
    # re-entrant, and ``release`` defers when this thread holds it: the garbage collector can run
    # a dropped reader's finalizer (which releases its holds) at any allocation made under it
    mu: threading.RLock = field(default_factory=threading.RLock)
    deferred: list[tuple[str, dict[str, Any] | None]] = field(default_factory=list)
    slots: dict[str, _Slot] = field(default_factory=dict)
    pool: ThreadPoolExecutor | None = None
    stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_STAT_KEYS, 0.0))
    max_bytes: int | None = None
    max_bytes_known: bool = False


class ShardCache:
    """A local, size-limited cache of remote shard files shared by all workers on a machine.

    ``acquire(url)`` returns the path of a complete local copy of ``url`` (downloading it if
    needed) and keeps it from eviction until ``release(url)``; ``prefetch(url)`` starts that
    download in the background and holds the file the same way. Local URLs are not cached:
    ``acquire`` returns them unchanged.

    Args:
        cache_dir: the cache folder (created); default ``$TORCHDATA_EXT_CACHE_DIR``, else
            ``<tempdir>/torchdata_ext_cache_<uid>``. Share one folder between all workers and
            ranks of a machine; put it on fast local disk.
        max_bytes: the size limit of the folder (bytes). Files nobody holds are evicted, least
            recently used first, to make room. A prefetch that does not fit is skipped (the file
            is downloaded when needed); a needed file is always downloaded, so the folder can
            exceed the limit by the file being downloaded. ``None``: no limit. ``"auto"``
            (default): half of the free disk space plus what the cache holds, measured when
            the process first downloads.
        storage_options: fsspec options used when a call passes none (credentials, endpoint).
        retry: the :class:`RetryPolicy` for every request.
        prefetch_threads: background download threads (per process).
        range_reads: read Arrow IPC files (one document per record batch), Parquet files and
            the token formats that can be read by range (CEPED ``.npy``, flat ``.bin``/``.npy``
            with an offsets sidecar) with range requests instead of downloading them (see
            :meth:`open_range`); other formats are still downloaded. Megatron pairs are always
            read by range.
        range_reads_above: files of a token format that can be read by range are, from this
            many bytes (as the dataset index lists them), even without ``range_reads``: the
            first batch then waits for a few requests, not for the whole download (a 10 GB
            shard). ``None``: never by size.
        block_size: bytes per range request, with ``range_reads``.
        own_retries: turn off the S3 client's own retries (``s3fs`` and ``botocore``) for the
            requests this cache makes, unless ``storage_options`` or ``AWS_MAX_ATTEMPTS`` set
            them, so that ``retry`` alone bounds the time spent on a failing object.

    Pickling keeps the configuration only (worker processes start with empty counters); after a
    ``fork`` the child drops the parent's locks and threads.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        max_bytes: int | None | Literal["auto"] = "auto",
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        prefetch_threads: int = 2,
        range_reads: bool = False,
        range_reads_above: int | None = 1 << 30,
        block_size: int = 8 << 20,
        own_retries: bool = True,
    ) -> None:
        if (
            max_bytes is not None
            and max_bytes != "auto"
            and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0)
        ):
            raise ValueError(f"{max_bytes=} must be an integer >= 0, None or 'auto'")
        for name, value, low in (
            ("prefetch_threads", prefetch_threads, 1),
            ("block_size", block_size, 1024),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry={retry!r} must be a RetryPolicy")
        self.cache_dir = os.path.abspath(os.fspath(cache_dir or default_cache_dir()))
        self.max_bytes = max_bytes
        self.storage_options = storage_options_of(storage_options)
        self.retry = retry or RetryPolicy()
        self.prefetch_threads = prefetch_threads
        self.range_reads = bool(range_reads)
        if range_reads_above is not None and (
            isinstance(range_reads_above, bool)
            or not isinstance(range_reads_above, int)
            or range_reads_above < 0
        ):
            raise ValueError(f"{range_reads_above=} must be an integer >= 0 or None")
        self.range_reads_above = range_reads_above
        self.block_size = block_size
        self.own_retries = own_retries
        self._rt = _Runtime()
        CACHES.add(self)

    # -- pickling / fork ----------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_rt", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._rt = _Runtime()
        CACHES.add(self)

    def _release_deferred(self, rt: _Runtime) -> None:
        """Drop the holds that finalizers released while this thread held the lock (not held
        now: the caller is outside it)."""
        while rt.deferred:
            url, storage_options = rt.deferred.pop()
            self.release(url, storage_options)

    def _runtime(self) -> _Runtime:
        if self._rt.pid != os.getpid():
            self.after_fork()
        return self._rt

    def after_fork(self) -> None:
        """Drop what this process inherited of its parent's cache: its holds (closing the
        copies of their locked files), threads and counters. Called in a forked child by
        :func:`~torchdata_ext.remote.process_state.reset_after_fork`, or on first use in a
        process whose copy came otherwise."""
        for slot in self._rt.slots.values():  # the parent's locks: drop our copies of the fds
            if slot.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(slot.fd)
        self._rt = _Runtime()

    def __repr__(self) -> str:
        return (
            f"ShardCache({self.cache_dir!r}, max_bytes={self.max_bytes!r}, "
            f"range_reads={self.range_reads})"
        )

    # -- public API ---------------------------------------------------------------------------
    def is_cached(self, url: str) -> bool:
        """Whether ``url`` goes through the cache (True for every non-local URL)."""
        return is_remote(url)

    def is_ready(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        """Whether ``url`` is cached, or being downloaded by this process."""
        if not self.is_cached(url):
            return True
        entry = self._entry(url, storage_options, ())
        rt = self._runtime()
        with rt.mu:
            slot = rt.slots.get(entry.local)
            if slot is not None and (slot.fd is not None or slot.future is not None):
                return True
        return os.path.exists(entry.local)

    def local_path(self, url: str, storage_options: dict[str, Any] | None = None) -> str:
        """Where the complete local copy of ``url`` is (or will be) kept."""
        return self._entry(url, storage_options, ()).local

    def acquire(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        companions: Sequence[str] = (),
        size: int | None = None,
    ) -> str:
        """A local path holding all of ``url``; downloads it (or waits for the download in
        flight here or in another process) when it is not cached yet.

        The file is held (not evicted) until a matching :meth:`release`. ``companions`` are
        suffixes of side files fetched with the file when they exist remotely (e.g.
        ``".offsets.npy"``: ``url + ".offsets.npy"`` lands at ``path + ".offsets.npy"``).
        ``size``: the file's size in bytes as its dataset index lists it, which spares the
        store a HEAD per download (None or negative: asked of the store). Local URLs are
        returned unchanged.

        Raises:
            FileNotFoundError: the object does not exist.
            RemoteError: access refused, missing bucket, or transient errors outlasted the
                retries.
        """
        if not self.is_cached(url):
            return url
        entry = self._entry(url, storage_options, companions, size)
        rt = self._runtime()
        self._release_deferred(rt)
        t0 = time.perf_counter()
        waited = False
        while True:
            with rt.mu:
                slot = rt.slots.setdefault(entry.local, _Slot())
                if slot.fd is not None:
                    slot.refs += 1
                    self._count("prefetch_waits" if waited else "cache_hits")
                    break
                fut = slot.future
                if fut is None:  # download it here; others in this process wait on `mine`
                    mine: Future = Future()
                    mine.set_running_or_notify_cancel()  # cannot be cancelled by release()
                    slot.future = mine
                    slot.refs += 1
            if fut is not None:
                waited = True
                with contextlib.suppress(Exception):
                    fut.result()  # a failed prefetch: this call fetches again, reports the error
                with rt.mu:
                    if slot.future is fut:
                        slot.future = None
                continue
            try:
                fd, outcome = self._fetch(entry, storage_options, prefetch=False)
            except BaseException as exc:
                with rt.mu:
                    slot.refs -= 1
                    slot.future = None
                    self._drop_if_unused(entry.local, slot)
                mine.set_exception(exc)
                raise
            with rt.mu:
                slot.fd = fd
                slot.future = None
                self._count("misses" if outcome == "downloaded" else "cache_hits")
            mine.set_result(True)
            break
        with rt.mu:
            rt.stats["wait_seconds"] += time.perf_counter() - t0
        disk.touch(entry.local)
        return entry.local

    def prefetch(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        companions: Sequence[str] = (),
        size: int | None = None,
    ) -> None:
        """Start downloading ``url`` in the background, and hold it like :meth:`acquire` until
        a matching :meth:`release` (``size`` as there). A prefetch that does not fit under
        ``max_bytes`` (with everything else held) is skipped; errors are left for
        :meth:`acquire` to report."""
        if not self.is_cached(url):
            return
        entry = self._entry(url, storage_options, companions, size)
        rt = self._runtime()
        self._release_deferred(rt)
        with rt.mu:
            slot = rt.slots.setdefault(entry.local, _Slot())
            slot.refs += 1
            if slot.fd is not None or slot.future is not None:
                return
            if rt.pool is None:
                rt.pool = ThreadPoolExecutor(
                    self.prefetch_threads, thread_name_prefix="shard-prefetch"
                )
            slot.future = rt.pool.submit(self._background, entry, storage_options)

    def release(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        """Drop one hold on ``url`` (from :meth:`acquire` or :meth:`prefetch`). When none is
        left the file may be evicted (it stays cached while there is room); a prefetch not
        started yet is cancelled."""
        if not self.is_cached(url):
            return
        rt = self._runtime()
        if rt.mu._is_owned():  # type: ignore[attr-defined]  # a finalizer run under the lock
            rt.deferred.append((url, storage_options))  # list.append: atomic, takes no lock
            return
        self._release_deferred(rt)
        entry = self._entry(url, storage_options, ())
        with rt.mu:
            slot = rt.slots.get(entry.local)
            if slot is None or slot.refs <= 0:
                return
            slot.refs -= 1
            if slot.refs > 0:
                return
            if slot.future is not None and slot.future.cancel():
                slot.future = None
            if slot.fd is not None:
                disk.touch(entry.local)
                os.close(slot.fd)
                slot.fd = None
            self._drop_if_unused(entry.local, slot)

    def discard(self, url: str, storage_options: dict[str, Any] | None = None) -> bool:
        """Delete the cached copy of ``url`` if nobody holds it (e.g. it turned out corrupt).
        Returns whether it was deleted."""
        if not self.is_cached(url):
            return False
        entry = self._entry(url, storage_options, ())
        return self._evict(entry.local) is not None

    def open_range(
        self, url: str, storage_options: dict[str, Any] | None = None, size: int | None = None
    ) -> RangeFile:
        """A seekable, read-only binary file over ``url`` that fetches ``block_size`` blocks
        with range requests (with retries), keeping a few recent blocks.

        ``size``: the file's size in bytes as its dataset index lists it, which spares the
        store a HEAD per file (None or negative: asked of the store); an object of another
        size is refused at its last block, naming the index and what to do."""
        fs, path = self._fs(url, storage_options)
        if size is not None and size >= 0:
            return RangeFile(self, fs, path, url, size, listed=True)
        info = with_retries(lambda: fs.info(path), url, self.retry, what="stat")
        return RangeFile(self, fs, path, url, int(info["size"]))

    def stats(self) -> dict[str, float]:
        """This process's counters since it started using the cache.

        ``bytes_downloaded``, ``downloads`` (files), ``prefetched`` (of those, in the
        background), ``cache_hits`` (acquires served at once), ``prefetch_waits`` (acquires that
        waited for a download in flight), ``misses`` (acquires that downloaded), ``wait_seconds``
        (time callers of :meth:`acquire` and range reads were blocked: the I/O time the reader
        saw), ``download_seconds`` (time spent downloading, in any thread), ``retries``,
        ``evictions``, ``evicted_bytes``, ``prefetch_skipped`` (no room), ``range_requests``.
        """
        rt = self._runtime()
        with rt.mu:
            return dict(rt.stats)

    def disk_usage(self) -> int:
        """Bytes in the cache folder now (complete files plus reserved partial downloads)."""
        return sum(size for _, size, _ in disk.scan(self.cache_dir))

    def close(self) -> None:
        """Release every hold of this process and stop the prefetch threads."""
        rt = self._runtime()
        with rt.mu:
            pool, rt.pool = rt.pool, None
            for slot in rt.slots.values():
                if slot.future is not None:
                    slot.future.cancel()
                slot.refs = 0
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        with rt.mu:
            for slot in rt.slots.values():
                if slot.fd is not None:
                    os.close(slot.fd)
                    slot.fd = None
            rt.slots.clear()

    # -- internals: names and filesystems ------------------------------------------------------
    def _options(self, storage_options: dict[str, Any] | None) -> dict[str, Any]:
        return dict(self.storage_options if storage_options is None else storage_options)

    def _entry(
        self,
        url: str,
        storage_options: dict[str, Any] | None,
        companions: Sequence[str],
        size: int | None = None,
    ) -> Entry:
        so = self._options(storage_options)
        endpoint = so.get("endpoint_url") or (so.get("client_kwargs") or {}).get("endpoint_url")
        return Entry.of(self.cache_dir, url, endpoint, companions, size)

    def _fs(self, url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
        """A filesystem for the caches of this process (not shared with other code), with
        retries left to :class:`RetryPolicy` when ``own_retries``."""
        return private_filesystem(url, self._options(storage_options), own_retries=self.own_retries)

    def _count(self, key: str, n: float = 1) -> None:
        self._rt.stats[key] += n  # callers hold rt.mu

    def _drop_if_unused(self, local: str, slot: _Slot) -> None:
        if slot.refs <= 0 and slot.fd is None and slot.future is None:
            self._rt.slots.pop(local, None)

    # -- internals: background prefetch -------------------------------------------------------
    def _background(self, entry: Entry, storage_options: dict[str, Any] | None) -> None:
        rt = self._runtime()
        with rt.mu:
            slot = rt.slots.get(entry.local)
            wanted = slot is not None and slot.refs > 0
        fd: int | None = None
        try:
            if wanted:
                fd, outcome = self._fetch(entry, storage_options, prefetch=True)
                if outcome == "skipped":
                    with rt.mu:
                        self._count("prefetch_skipped")
        except Exception as exc:
            logger.debug(
                "prefetch of %s failed (%s); it is fetched again when needed", entry.url, exc
            )
        with rt.mu:
            slot = rt.slots.get(entry.local)
            if slot is not None and slot.refs > 0 and slot.fd is None and fd is not None:
                slot.fd = fd
                fd = None
            if slot is not None:
                slot.future = None
                self._drop_if_unused(entry.local, slot)
        if fd is not None:  # nobody wants it any more: it stays cached, unheld
            os.close(fd)

    # -- internals: download, eviction --------------------------------------------------------
    def _fetch(
        self, entry: Entry, storage_options: dict[str, Any] | None, prefetch: bool
    ) -> tuple[int | None, str]:
        """:func:`.disk.fetch` with this cache's download: (lock fd, outcome)."""
        return disk.fetch(entry, partial(self._download, entry, storage_options, prefetch))

    def _download(
        self, entry: Entry, storage_options: dict[str, Any] | None, prefetch: bool
    ) -> bool:
        fs, path = self._fs(entry.url, storage_options)
        rt = self._runtime()

        def count_retry(_: BaseException) -> None:
            with rt.mu:
                self._count("retries")

        sizes: list[tuple[str, str, str, int]] = []  # (url, remote path, local path, size)
        for suffix in ("", *entry.companions):
            rurl, rpath = entry.url + suffix, path + suffix
            if not suffix and entry.size is not None:  # as the dataset index lists it
                sizes.append((rurl, rpath, entry.local, entry.size))
                continue
            try:
                info = with_retries(
                    partial(fs.info, rpath), rurl, self.retry, what="stat", on_retry=count_retry
                )
            except FileNotFoundError:
                if suffix:
                    continue  # an optional side file
                raise
            sizes.append((rurl, rpath, entry.local + suffix, int(info["size"])))
        total = sum(s for *_, s in sizes)
        parts = self._reserve(entry, [s for *_, s in sizes], prefetch)
        if parts is None:
            return False
        t0 = time.perf_counter()
        # a foreground wait may show a bar; a prefetch thread's only logs
        progress = Progress(
            f"downloading {entry.url}", logger, total=total, unit="B", bar=not prefetch
        )
        try:
            with progress:
                done = 0
                for (rurl, rpath, local, size), tmp in zip(sizes, parts):
                    listed = local == entry.local and entry.size is not None
                    with_retries(
                        partial(_get_file, fs, rpath, tmp, size, progress, done, listed),
                        rurl, self.retry, what="download", on_retry=count_retry,
                    )  # fmt: skip
                    done += size
            # companions first: the main file appearing is what marks the entry complete
            for (_, _, local, _), tmp in list(zip(sizes, parts))[::-1]:
                os.replace(tmp, local)
        finally:
            for tmp in parts:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        seconds = time.perf_counter() - t0
        with rt.mu:
            self._count("downloads")
            self._count("bytes_downloaded", total)
            self._count("download_seconds", seconds)
            if prefetch:
                self._count("prefetched")
        logger.debug(
            "downloaded %s (%d bytes in %.2fs, %.1f MB/s%s) to %s",
            entry.url,
            total,
            seconds,
            total / max(seconds, 1e-9) / 1e6,
            ", prefetch" if prefetch else "",
            entry.local,
        )
        return True

    def _limit(self, used: int) -> int | None:
        """The size limit; ``"auto"`` is fixed at the first download of this process, from the
        free space plus what the cache already holds (so all processes agree)."""
        rt = self._rt
        if not rt.max_bytes_known:
            if self.max_bytes == "auto":
                st = os.statvfs(self.cache_dir)
                rt.max_bytes = int((st.f_bavail * st.f_frsize + used) * _AUTO_FRACTION)
            else:
                rt.max_bytes = self.max_bytes
            rt.max_bytes_known = True
        return rt.max_bytes

    def _reserve(self, entry: Entry, sizes: list[int], prefetch: bool) -> list[str] | None:
        """:func:`.disk.reserve` under this cache's limit; None: a prefetch that does not fit."""
        return disk.reserve(
            self.cache_dir,
            entry.local,
            sizes,
            limit=None if self.max_bytes is None else self._limit,
            evict_file=self._evict,
            prefetch=prefetch,
        )

    def _evict(self, local: str) -> int | None:
        """:func:`.disk.evict`, counted; bytes freed or None (held by someone)."""
        freed = disk.evict(local)
        if freed is not None:
            rt = self._runtime()
            with rt.mu:
                self._count("evictions")
                self._count("evicted_bytes", freed)
        return freed


def _get_file(
    fs: Any, rpath: str, tmp: str, size: int, progress: Progress, done: int, listed: bool = False
) -> None:
    """Download ``rpath`` to ``tmp``, which must then hold ``size`` bytes (``listed``: the size
    the dataset index lists, not the store's answer to a HEAD just before)."""
    fs.get_file(rpath, tmp, callback=fsspec_callback(progress, done))
    got = os.path.getsize(tmp)
    if got != size:
        why = (
            f"downloaded {got} bytes where the dataset index lists {size}: the transfer was "
            "cut short, or the file changed after the index was made (rebuild it with "
            "`torchdata-ext index`)"
            if listed
            else f"downloaded {got} bytes of {size}; the transfer was cut short"
        )
        raise IncompleteDownload(errno.EIO, why)
