"""Object storage at full speed: retries, a shared local shard cache, background prefetch.

Three pieces, usable on their own and wired into :class:`~torchdata_ext.nodes.ShardReader`:

* :class:`RetryPolicy` and :func:`with_retries`: exponential backoff with full jitter on
  transient errors (HTTP 5xx / 429 / ``SlowDown``, connection resets, timeouts, truncated
  bodies), a bounded number of attempts and of total time, then a :class:`RemoteError` naming the
  URL. Permanent errors are not retried: a missing bucket or bad credentials raise a
  :class:`RemoteError` at once saying what to check; a missing object raises
  ``FileNotFoundError``.
* :class:`ShardCache`: whole-file downloads of remote shard files into a local directory shared
  by every worker and rank on the machine. A file is downloaded under a temporary name and
  renamed, so a partly downloaded file is never read; a per-file ``flock`` lock makes sure two
  processes never download the same file at once (the second waits and then finds the complete
  file); a size limit evicts least-recently-used files that nobody holds. Downloads of the files
  a reader needs next run in a small background thread pool (:meth:`ShardCache.prefetch`).
  Counters (:meth:`ShardCache.stats`) say whether I/O is the bottleneck.
* Range reads (``ShardCache(range_reads=True)``): no download; Arrow IPC files (one document per
  record batch) and Parquet files are read with HTTP range requests, through
  :meth:`ShardCache.open_range`.

Cache layout (``cache_dir``)::

    .cache.lock                          global lock: space accounting and eviction
    <hash of endpoint + remote folder>/  one folder per remote folder
        part_0001.arrow                  complete files only (companions beside them)
        .part_0001.arrow.lock            per-file lock: shared while in use, exclusive to
                                         download or evict
        .part_0001.arrow.0.part-<size>-<pid>-<rand>  a download in progress (size reserved)

Locks: a process holds a *shared* lock on a file's lock file while it uses or has prefetched
the file (so nobody evicts it), and an *exclusive* one while it downloads or evicts it. Locks
are ``flock`` locks, released by the kernel when a process dies, so a killed worker never leaves
the cache locked; its partial download (whose lock is then free) is deleted by the next process
that scans the cache. The folder must be on a local filesystem (``flock`` on NFS is unreliable).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import logging
import os
import random
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeVar

from fsspec.core import split_protocol

from torchdata_ext.urls import filesystem, is_local

__all__ = [
    "RemoteError",
    "RetryPolicy",
    "ShardCache",
    "check_access",
    "is_remote",
    "is_transient",
    "read_bytes",
    "with_retries",
    "write_bytes_atomic",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_LOCAL_PROTOCOLS = (None, "file", "local")
_PART = ".part-"
_LOCK_SUFFIX = ".lock"
_GLOBAL_LOCK = ".cache.lock"
_AUTO_FRACTION = 0.5  # max_bytes="auto": this share of the free disk space at first use

# S3 / HTTP error codes worth retrying (throttling, server-side trouble, timeouts)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "RequestTimeoutException",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "BandwidthLimitExceeded",
        "PriorRequestNotComplete",
        "OperationAborted",
        "429",
        "500",
        "502",
        "503",
        "504",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EAGAIN,
        errno.EBUSY,  # s3fs: 503 SlowDown / ServiceUnavailable
        getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: 500 InternalError
    }
)
_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AccountProblem",
        "AllAccessDisabled",
        "403",
    }
)
_CREDENTIALS_HINT = (
    "check the credentials (storage_options key/secret/token, or the environment variables "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN / AWS_PROFILE), the bucket's "
    "access policy, and the endpoint (storage_options client_kwargs endpoint_url, or "
    "AWS_ENDPOINT_URL)"
)


class RemoteError(OSError):
    """Remote storage failed: transient errors that outlasted the retries, a missing bucket,
    refused credentials, or an unreachable endpoint.

    The reader never skips a file for this error (``on_error="skip"`` is for bad files, not for
    an outage), so a checkpoint never records healthy files as skipped.

    Attributes:
        url: the URL at fault.
        transient: True when the retries ran out (the store may work again later).
    """

    def __init__(self, url: str, message: str, *, transient: bool = False) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.transient = transient

    def __reduce__(self) -> Any:  # keep url and message through pickling (worker processes)
        return _rebuild_remote_error, (self.url, str(self), self.transient)


def _rebuild_remote_error(url: str, text: str, transient: bool) -> RemoteError:
    err = RemoteError(url, "", transient=transient)
    err.args = (text,)
    return err


class _IncompleteDownload(OSError):
    """A download ended with fewer (or more) bytes than the object has: retried."""


# --------------------------------------------------------------------------------- retries
@dataclass(frozen=True)
class RetryPolicy:
    """How transient errors are retried: exponential backoff with full jitter, bounded.

    Attempt ``k`` (from 1) that fails transiently is followed by a sleep drawn uniformly from
    ``[0, min(max_delay_s, base_delay_s * 2 ** (k - 1))]``. The call gives up with a
    :class:`RemoteError` after ``max_attempts`` attempts, or as soon as the next sleep would end
    after ``total_timeout_s`` seconds from the first attempt (a single slow attempt is bounded by
    the filesystem's own timeouts).

    Args:
        max_attempts: attempts in all (>= 1; 1 = no retry).
        base_delay_s: the first backoff bound, seconds.
        max_delay_s: the largest backoff bound, seconds.
        total_timeout_s: the bound on the time spent retrying one operation, seconds.
    """

    max_attempts: int = 8
    base_delay_s: float = 0.25
    max_delay_s: float = 8.0
    total_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise TypeError(f"max_attempts={self.max_attempts!r} must be an integer")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts} must be >= 1")
        for name in ("base_delay_s", "max_delay_s", "total_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name}={v!r} must be a number >= 0")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The sleep after failed attempt ``attempt`` (1-based): full jitter."""
        bound = min(self.max_delay_s, self.base_delay_s * 2.0 ** min(attempt - 1, 60))
        return (rng or random).uniform(0.0, bound)


def with_retries(
    fn: Callable[[], T],
    url: str,
    policy: RetryPolicy | None = None,
    *,
    what: str = "read",
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Call ``fn()``, retrying transient errors under ``policy``.

    Args:
        fn: the operation (no arguments).
        url: the URL it works on, named in errors and logs.
        policy: the retry policy (default :class:`RetryPolicy()`).
        what: a few words for messages (``"download"``, ``"list"``...).
        on_retry: called with the error before each retry (e.g. to count retries).

    Raises:
        RemoteError: the retries ran out (``transient=True``), or a permanent error that is
            about access or the bucket (message says what to check).
        FileNotFoundError: the object does not exist (unchanged, so callers can handle it).
        Exception: any other permanent error, unchanged.
    """
    policy = policy or RetryPolicy()
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                clear = explain_error(url, exc, what)
                if clear is exc:
                    raise
                raise clear from exc
            elapsed = time.monotonic() - start
            pause = policy.delay(attempt)
            if attempt >= policy.max_attempts or elapsed + pause > policy.total_timeout_s:
                raise RemoteError(
                    url,
                    f"{what} failed {attempt} time(s) over {elapsed:.1f}s with transient errors "
                    f"(last: {_describe(exc)}); the store or the network kept failing: check the "
                    "endpoint and the network, or allow more time with "
                    "RetryPolicy(total_timeout_s=..., max_attempts=...)",
                    transient=True,
                ) from exc
            log = logger.warning if attempt == 1 else logger.debug
            log(
                "%s of %s failed (%s); retry %d in %.2fs",
                what,
                url,
                _describe(exc),
                attempt,
                pause,
            )
            if on_retry is not None:
                on_retry(exc)
            time.sleep(pause)


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(out) < 12 and all(cur is not x for x in out):
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _client_error_info(exc: BaseException) -> tuple[str, int] | None:
    """(code, HTTP status) of a botocore ``ClientError``-like exception, else None."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or "Error" not in response:
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _is_transient_one(exc: BaseException) -> bool | None:
    """True / False when ``exc`` alone decides, None to look further down the chain."""
    if isinstance(exc, RemoteError):
        return False
    if isinstance(exc, _IncompleteDownload):
        return True
    info = _client_error_info(exc)
    if info is not None:
        code, status = info
        return code in _TRANSIENT_CODES or status >= 500 or status == 429
    if isinstance(
        exc,
        (
            FileNotFoundError,
            PermissionError,
            IsADirectoryError,
            NotADirectoryError,
            FileExistsError,
        ),
    ):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if module.startswith("botocore"):
        if name in ("NoCredentialsError", "PartialCredentialsError", "NoRegionError"):
            return False
        if name in ("ResponseParserError", "IncompleteReadError"):
            return True
        mro = {c.__name__ for c in type(exc).__mro__}
        if mro & {"HTTPClientError", "ConnectionError"}:
            return True
    if module.startswith("aiohttp"):
        http_status = getattr(exc, "status", None)
        if name == "ClientResponseError" and isinstance(http_status, int) and http_status < 500:
            return http_status == 429
        return True  # payload cut short, disconnected, connection reset, bad status line
    if name in ("FSTimeoutError", "IncompleteRead", "RemoteDisconnected"):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is worth retrying.

    Transient: HTTP 5xx, 429 and the S3 throttling codes (``SlowDown``...), connection resets and
    refusals, timeouts, truncated or unparsable responses (botocore, aiohttp, ``OSError`` with
    ``ECONNRESET``...). Permanent: missing objects or buckets, access denied, bad or missing
    credentials, other 4xx, and anything unknown.
    """
    for e in _chain(exc):
        verdict = _is_transient_one(e)
        if verdict is not None:
            return verdict
    return False


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def explain_error(url: str, exc: BaseException, what: str = "read") -> BaseException:
    """A permanent error made clear: a :class:`RemoteError` for access, credentials and missing
    buckets (saying what to check), ``exc`` itself otherwise."""
    if isinstance(exc, RemoteError):
        return exc
    chain = _chain(exc)
    codes = {info[0] for e in chain if (info := _client_error_info(e)) is not None}
    names = {type(e).__name__ for e in chain}
    text = " ".join(str(e) for e in chain)
    if "NoSuchBucket" in codes or "bucket does not exist" in text:
        return RemoteError(
            url,
            f"{what} failed: the bucket does not exist ({_describe(exc)}); check the bucket name "
            "in the URL and the endpoint (storage_options client_kwargs endpoint_url)",
        )
    if names & {"NoCredentialsError", "PartialCredentialsError"}:
        return RemoteError(
            url,
            f"{what} failed: no credentials were found ({_describe(exc)}); pass "
            "storage_options={'key': ..., 'secret': ...}, set AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or storage_options={'anon': True} for a "
            "public bucket",
        )
    if codes & _AUTH_CODES or isinstance(exc, PermissionError):
        return RemoteError(
            url, f"{what} failed: access denied ({_describe(exc)}); {_CREDENTIALS_HINT}"
        )
    return exc


def check_access(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Raise a clear :class:`RemoteError` if ``url``'s bucket is missing or refuses access.

    Used to explain a listing that found nothing: ``no files match`` is often a wrong bucket,
    wrong credentials or a wrong endpoint. Does nothing for local URLs or when all looks fine.
    """
    if not is_remote(url):
        return
    fs, path = filesystem(url, storage_options)
    bucket = path.split("/", 1)[0]
    if not bucket:
        return
    with_retries(lambda: fs.ls(bucket, detail=False, refresh=True), url, what="list")


# ---------------------------------------------------------------------- small public helpers
def is_remote(url: str) -> bool:
    """Whether ``url`` is on a non-local filesystem (anything but a path or ``file://``)."""
    return split_protocol(str(url))[0] not in _LOCAL_PROTOCOLS


def read_bytes(
    url: str, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None
) -> bytes:
    """The content of ``url``, with retries."""
    fs, path = filesystem(url, storage_options)
    return bytes(with_retries(lambda: fs.cat_file(path), url, retry, what="read"))


def write_bytes_atomic(
    url: str,
    data: bytes,
    storage_options: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> None:
    """Write ``data`` to ``url`` so a reader sees the old content or the new, never a part.

    Local files are written to a temporary name in the same folder, flushed to disk and renamed.
    On object stores a single PUT is atomic (the object appears whole or not at all), so the
    object is written in one call, with retries.
    """
    fs, path = filesystem(url, storage_options)
    if is_local(fs):
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return
    with_retries(lambda: fs.pipe_file(path, data), url, retry, what="write")


# ----------------------------------------------------------------------------- the cache
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
    mu: threading.Lock = field(default_factory=threading.Lock)
    slots: dict[str, _Slot] = field(default_factory=dict)
    pool: ThreadPoolExecutor | None = None
    stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_STAT_KEYS, 0.0))
    max_bytes: int | None = None
    max_bytes_known: bool = False


_CACHES: weakref.WeakSet[ShardCache] = weakref.WeakSet()
# filesystems of the caches of this process, by protocol and options (clients are slow to make)
_FILESYSTEMS: dict[str, Any] = {}
_FS_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Entry:
    url: str
    local: str  # where the complete file lives
    lock: str  # its lock file
    companions: tuple[str, ...]  # suffixes of side files fetched with it (if they exist)


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
        range_reads: read Arrow IPC files (one document per record batch) and Parquet files with
            range requests instead of downloading them (see :meth:`open_range`); other formats
            are still downloaded.
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
        self.storage_options = dict(storage_options or {})
        self.retry = retry or RetryPolicy()
        self.prefetch_threads = prefetch_threads
        self.range_reads = bool(range_reads)
        self.block_size = block_size
        self.own_retries = own_retries
        self._rt = _Runtime()
        _CACHES.add(self)

    # -- pickling / fork ----------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_rt", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._rt = _Runtime()
        _CACHES.add(self)

    def _runtime(self) -> _Runtime:
        if self._rt.pid != os.getpid():
            self._after_fork()
        return self._rt

    def _after_fork(self) -> None:
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
    ) -> str:
        """A local path holding all of ``url``; downloads it (or waits for the download in
        flight here or in another process) when it is not cached yet.

        The file is held (not evicted) until a matching :meth:`release`. ``companions`` are
        suffixes of side files fetched with the file when they exist remotely (e.g.
        ``".offsets.npy"``: ``url + ".offsets.npy"`` lands at ``path + ".offsets.npy"``).
        Local URLs are returned unchanged.

        Raises:
            FileNotFoundError: the object does not exist.
            RemoteError: access refused, missing bucket, or transient errors outlasted the
                retries.
        """
        if not self.is_cached(url):
            return url
        entry = self._entry(url, storage_options, companions)
        rt = self._runtime()
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
        _touch(entry.local)
        return entry.local

    def prefetch(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        companions: Sequence[str] = (),
    ) -> None:
        """Start downloading ``url`` in the background, and hold it like :meth:`acquire` until
        a matching :meth:`release`. A prefetch that does not fit under ``max_bytes`` (with
        everything else held) is skipped; errors are left for :meth:`acquire` to report."""
        if not self.is_cached(url):
            return
        entry = self._entry(url, storage_options, companions)
        rt = self._runtime()
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
        entry = self._entry(url, storage_options, ())
        rt = self._runtime()
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
                _touch(entry.local)
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

    def open_range(self, url: str, storage_options: dict[str, Any] | None = None) -> RangeFile:
        """A seekable, read-only binary file over ``url`` that fetches ``block_size`` blocks
        with range requests (with retries), keeping a few recent blocks."""
        fs, path = self._fs(url, storage_options)
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
        return sum(size for _, size, _ in self._scan())

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
        self, url: str, storage_options: dict[str, Any] | None, companions: Sequence[str]
    ) -> _Entry:
        so = self._options(storage_options)
        endpoint = so.get("endpoint_url") or (so.get("client_kwargs") or {}).get("endpoint_url")
        folder, _, name = url.rstrip("/").rpartition("/")
        digest = hashlib.sha256(f"{endpoint or ''}|{folder}".encode()).hexdigest()[:20]
        base = os.path.join(self.cache_dir, digest)
        return _Entry(
            url,
            os.path.join(base, name),
            os.path.join(base, f".{name}{_LOCK_SUFFIX}"),
            tuple(companions),
        )

    def _fs(self, url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
        """A filesystem for the caches of this process (not shared with other code), with
        retries left to :class:`RetryPolicy` when ``own_retries``."""
        so = self._options(storage_options)
        protocol = split_protocol(url)[0] or "file"
        own = self.own_retries and "AWS_MAX_ATTEMPTS" not in os.environ
        key = f"{protocol}|{own}|{sorted(so.items())!r}"
        with _FS_LOCK:
            hit = _FILESYSTEMS.get(key)
        if hit is None:
            opts = dict(so)
            s3 = protocol in ("s3", "s3a")
            if s3 and own:
                config = dict(opts.get("config_kwargs") or {})
                config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
                opts["config_kwargs"] = config
            opts["skip_instance_cache"] = True
            fs, _ = filesystem(url, opts)
            if s3 and own:
                fs.retries = 1  # s3fs's own retry loop (a class attribute)
            with _FS_LOCK:
                hit = _FILESYSTEMS.setdefault(key, fs)
        return hit, hit._strip_protocol(url)

    def _count(self, key: str, n: float = 1) -> None:
        self._rt.stats[key] += n  # callers hold rt.mu

    def _drop_if_unused(self, local: str, slot: _Slot) -> None:
        if slot.refs <= 0 and slot.fd is None and slot.future is None:
            self._rt.slots.pop(local, None)

    # -- internals: background prefetch -------------------------------------------------------
    def _background(self, entry: _Entry, storage_options: dict[str, Any] | None) -> None:
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

    # -- internals: locking, download, eviction ------------------------------------------------
    def _fetch(
        self, entry: _Entry, storage_options: dict[str, Any] | None, prefetch: bool
    ) -> tuple[int | None, str]:
        """Make ``entry`` complete locally; returns (lock fd holding a shared lock, outcome)
        with outcome ``"hit"``, ``"downloaded"``, or ``"skipped"`` (prefetch without room; fd
        None)."""
        os.makedirs(os.path.dirname(entry.local), exist_ok=True)
        while True:
            fd = _open_lock(entry.lock, fcntl.LOCK_SH)
            if os.path.exists(entry.local):
                return fd, "hit"
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            fd = _open_lock(entry.lock, fcntl.LOCK_EX)  # waits for a download elsewhere
            try:
                if not os.path.exists(entry.local):
                    if not self._download(entry, storage_options, prefetch):
                        fcntl.flock(fd, fcntl.LOCK_UN)
                        os.close(fd)
                        return None, "skipped"
                    outcome = "downloaded"
                else:
                    outcome = "hit"
                fcntl.flock(fd, fcntl.LOCK_SH)  # downgrade; re-check below
            except BaseException:
                os.close(fd)
                raise
            if os.path.exists(entry.local):
                return fd, outcome
            os.close(fd)  # evicted in the instant between the locks: start again

    def _download(
        self, entry: _Entry, storage_options: dict[str, Any] | None, prefetch: bool
    ) -> bool:
        fs, path = self._fs(entry.url, storage_options)
        rt = self._runtime()

        def count_retry(_: BaseException) -> None:
            with rt.mu:
                self._count("retries")

        sizes: list[tuple[str, str, str, int]] = []  # (url, remote path, local path, size)
        for suffix in ("", *entry.companions):
            rurl, rpath = entry.url + suffix, path + suffix
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
        try:
            for (rurl, rpath, _, size), tmp in zip(sizes, parts):
                with_retries(
                    partial(_get_file, fs, rpath, tmp, size),
                    rurl, self.retry, what="download", on_retry=count_retry,
                )  # fmt: skip
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

    def _reserve(self, entry: _Entry, sizes: list[int], prefetch: bool) -> list[str] | None:
        """Make room for ``sum(sizes)`` bytes and create the reserved partial files (their
        names carry their sizes), under the global lock. None: a prefetch that does not fit."""
        os.makedirs(self.cache_dir, exist_ok=True)
        need = sum(sizes)
        gfd = os.open(os.path.join(self.cache_dir, _GLOBAL_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(gfd, fcntl.LOCK_EX)
            files = self._scan() if self.max_bytes is not None else []
            used = sum(size for _, size, _ in files)
            limit = self._limit(used)
            if limit is not None:
                if used + need > limit:
                    for local, _, _ in sorted(
                        (f for f in files if f[2] is not None), key=lambda f: f[2] or 0.0
                    ):
                        freed = self._evict(local)
                        if freed is not None:
                            used -= freed
                            if used + need <= limit:
                                break
                if used + need > limit and prefetch:
                    return None
            folder, name = os.path.split(entry.local)
            token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
            parts = []
            for k, size in enumerate(sizes):
                part = os.path.join(folder, f".{name}.{k}{_PART}{size}-{token}")
                with open(part, "wb"):
                    pass
                parts.append(part)
            return parts
        finally:
            fcntl.flock(gfd, fcntl.LOCK_UN)
            os.close(gfd)

    def _scan(self) -> list[tuple[str, int, float | None]]:
        """Every file in the cache: (path, bytes counted, last use for complete files / None for
        partial ones). Partial files of dead processes are deleted. Companions count with their
        main file."""
        out: list[tuple[str, int, float | None]] = []
        try:
            folders = [e for e in os.scandir(self.cache_dir) if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return out
        for folder in folders:
            try:
                entries = list(os.scandir(folder.path))
            except FileNotFoundError:
                continue
            complete: dict[str, tuple[int, float]] = {}
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if e.name.startswith("."):
                    if _PART in e.name:
                        reserved, owner_name = _parse_part(e.name)
                        if _stale_part(folder.path, owner_name):
                            _unlink(e.path)
                            continue
                        out.append((e.path, max(reserved, st.st_size), None))
                    continue
                complete[e.name] = (st.st_size, st.st_atime)  # last use: see _touch
            totals: dict[str, int] = {}
            for name, (size, _) in complete.items():
                owner = _companion_owner(name, complete)  # companions count with their file
                key = name if owner is None else owner
                totals[key] = totals.get(key, 0) + size
            for name, total in totals.items():
                out.append((os.path.join(folder.path, name), total, complete[name][1]))
        return out

    def _evict(self, local: str) -> int | None:
        """Delete a complete file (and its companions) if nobody holds it; bytes freed or None."""
        folder, name = os.path.split(local)
        lock = os.path.join(folder, f".{name}{_LOCK_SUFFIX}")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # in use (or being downloaded) by someone
            if not _same_file(fd, lock):
                return None
            freed = 0
            victims = [local] + [
                os.path.join(folder, n)
                for n in _listdir(folder)
                if n != name and _companion_owner(n, {name})
            ]
            for path in victims:
                try:
                    freed += os.stat(path).st_size
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            _unlink(lock)  # holders of the old lock file notice (inode check) and reopen
            rt = self._runtime()
            with rt.mu:
                self._count("evictions")
                self._count("evicted_bytes", freed)
            logger.debug("evicted %s (%d bytes) from the shard cache", local, freed)
            return freed
        finally:
            os.close(fd)


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote object through range requests (with retries).

    Reads of less than ``block_size`` bytes are served from whole blocks, keeping the last few.
    Time spent in requests counts as ``wait_seconds`` of the cache.
    """

    _KEEP_BLOCKS = 4

    def __init__(self, cache: ShardCache, fs: Any, path: str, url: str, size: int) -> None:
        super().__init__()
        self._cache = cache
        self._fs = fs
        self._path = path
        self.url = url
        self.size = size
        self._pos = 0
        self._blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def _get(self, start: int, end: int) -> bytes:
        rt = self._cache._runtime()
        t0 = time.perf_counter()

        def count_retry(_: BaseException) -> None:
            with rt.mu:
                self._cache._count("retries")

        data = with_retries(
            lambda: self._fs.cat_file(self._path, start=start, end=end),
            self.url, self._cache.retry, what="range read", on_retry=count_retry,
        )  # fmt: skip
        if len(data) != end - start:
            raise RemoteError(
                self.url,
                f"a range read of bytes {start}..{end} returned {len(data)} bytes; the object "
                "changed while it was read: rebuild the dataset index",
            )
        seconds = time.perf_counter() - t0
        with rt.mu:
            self._cache._count("range_requests")
            self._cache._count("bytes_downloaded", len(data))
            self._cache._count("wait_seconds", seconds)
            self._cache._count("download_seconds", seconds)
        return bytes(data)

    def read(self, size: int | None = -1) -> bytes:
        start = self._pos
        end = self.size if size is None or size < 0 else min(self.size, start + size)
        if end <= start:
            return b""
        bs = self._cache.block_size
        if end - start >= bs:
            data = self._get(start, end)
        else:
            chunks = []
            for k in range(start // bs, (end - 1) // bs + 1):
                block = self._blocks.pop(k, None)
                if block is None:
                    block = self._get(k * bs, min(self.size, (k + 1) * bs))
                self._blocks[k] = block  # most recent last
                lo = max(start, k * bs) - k * bs
                hi = min(end, (k + 1) * bs) - k * bs
                chunks.append(block[lo:hi])
            while len(self._blocks) > self._KEEP_BLOCKS:
                self._blocks.pop(next(iter(self._blocks)))
            data = b"".join(chunks)
        self._pos = end
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        n = len(data)
        memoryview(buffer).cast("B")[:n] = data
        return n


# ---------------------------------------------------------------------------- small helpers
def default_cache_dir() -> str:
    """``$TORCHDATA_EXT_CACHE_DIR``, else ``<tempdir>/torchdata_ext_cache_<uid>``."""
    env = os.environ.get("TORCHDATA_EXT_CACHE_DIR")
    if env:
        return env
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"torchdata_ext_cache_{uid}")


def _get_file(fs: Any, rpath: str, tmp: str, size: int) -> None:
    fs.get_file(rpath, tmp)
    got = os.path.getsize(tmp)
    if got != size:
        raise _IncompleteDownload(
            errno.EIO, f"downloaded {got} bytes of {size}; the transfer was cut short"
        )


def _open_lock(path: str, how: int) -> int:
    """Open ``path`` and lock it (``flock``), retrying if it was deleted meanwhile (an eviction
    deletes the lock file it held)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, how)
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _touch(path: str) -> None:
    """Mark ``path`` as used now (its access time, for least-recently-used eviction); the
    modification time stays the download time, so readers keying caches on it are not fooled."""
    with contextlib.suppress(OSError):
        os.utime(path, (time.time(), os.stat(path).st_mtime))


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def _parse_part(name: str) -> tuple[int, str]:
    """(reserved bytes, file name) from ``.<file name>.<k>.part-<size>-<pid>-<rand>``."""
    head, _, tail = name[1:].rpartition(_PART)
    try:
        size = int(tail.split("-", 1)[0])
    except ValueError:
        size = 0
    return size, head.rpartition(".")[0]


def _stale_part(folder: str, name: str) -> bool:
    """Whether a partial download of ``name`` is left over from a process that died: its
    downloader holds the file's lock for as long as it runs (in any process or container
    sharing the folder), so a free lock means nobody will finish it."""
    lock = os.path.join(folder, f".{name}{_LOCK_SUFFIX}")
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


# suffixes of side files that travel with their main file (see ShardCache.acquire)
COMPANION_SUFFIXES: set[str] = {".offsets.npy"}


def _companion_owner(name: str, names: Iterable[str]) -> str | None:
    for suffix in COMPANION_SUFFIXES:
        if name.endswith(suffix):
            owner = name[: -len(suffix)]
            if owner in names:
                return owner
    return None


def _reset_after_fork() -> None:
    global _FS_LOCK
    _FS_LOCK = threading.Lock()
    _FILESYSTEMS.clear()  # event loops and connections do not survive a fork
    for cache in list(_CACHES):
        cache._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
