"""The shard cache's folder on disk, shared by the processes of a machine via files and locks.

Layout (``cache_dir``)::

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

Everything here works on the folder alone, with no per-process state: where a file goes
(:class:`Entry`), making an entry complete under its lock (:func:`fetch`), reserving room by
evicting least-recently-used files nobody holds (:func:`reserve`, :func:`scan`, :func:`evict`),
and marking a file used (:func:`touch`). :class:`~torchdata_ext.remote.ShardCache` adds the
holds, threads and counters of one process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["COMPANION_SUFFIXES", "Entry", "evict", "fetch", "reserve", "scan", "touch"]

logger = logging.getLogger(__name__)

_PART = ".part-"
_LOCK_SUFFIX = ".lock"
_GLOBAL_LOCK = ".cache.lock"
# seconds between two tries at a file's exclusive lock when another process holds it (it is
# reading the file, or about to find it missing too: see fetch)
_LOCK_RETRY_S = 0.005

# suffixes of side files that travel with their main file (see ShardCache.acquire)
COMPANION_SUFFIXES: set[str] = {".offsets.npy"}


@dataclass(frozen=True)
class Entry:
    """Where one remote file and its lock live in the cache."""

    url: str
    local: str  # where the complete file lives
    lock: str  # its lock file
    companions: tuple[str, ...]  # suffixes of side files fetched with it (if they exist)
    size: int | None = None  # the file's size as its dataset index lists it (None: ask the store)

    @classmethod
    def of(
        cls,
        cache_dir: str,
        url: str,
        endpoint: str | None,
        companions: Sequence[str],
        size: int | None = None,
    ) -> Entry:
        """The entry of ``url`` (served by ``endpoint``): one folder per remote folder."""
        folder, _, name = url.rstrip("/").rpartition("/")
        digest = hashlib.sha256(f"{endpoint or ''}|{folder}".encode()).hexdigest()[:20]
        base = os.path.join(cache_dir, digest)
        return cls(
            url,
            os.path.join(base, name),
            os.path.join(base, f".{name}{_LOCK_SUFFIX}"),
            tuple(companions),
            size if size is not None and size >= 0 else None,
        )


def fetch(entry: Entry, download: Callable[[], bool]) -> tuple[int | None, str]:
    """Make ``entry`` complete locally; returns (lock fd holding a shared lock, outcome)
    with outcome ``"hit"``, ``"downloaded"``, or ``"skipped"`` (prefetch without room; fd
    None).

    ``download()`` is called with the entry's exclusive lock held when the file is missing;
    it returns False to skip (nothing downloaded)."""
    os.makedirs(os.path.dirname(entry.local), exist_ok=True)
    while True:
        fd = _open_lock(entry.lock, fcntl.LOCK_SH)  # waits out a download elsewhere
        if os.path.exists(entry.local):
            return fd, "hit"
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        # Missing: take the exclusive lock to download it, without waiting for it. A process
        # that holds the shared lock keeps it while it reads the file, for as long as its
        # loader runs, so a blocked wait for the exclusive lock could last forever: another
        # process that downloaded the file meanwhile turns its exclusive lock into a shared
        # one, and flock's conversion is not atomic (a waiter for the exclusive lock can be
        # passed by it). Without the lock, start again: the shared lock waits out a download
        # in progress, and finds the file once it is there.
        got = _try_lock(entry.lock, fcntl.LOCK_EX)
        if got is None:
            time.sleep(_LOCK_RETRY_S)
            continue
        fd = got
        try:
            if not os.path.exists(entry.local):
                if not download():
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


def reserve(
    cache_dir: str,
    local: str,
    sizes: list[int],
    *,
    limit: Callable[[int], int | None] | None,
    evict_file: Callable[[str], int | None],
    prefetch: bool,
) -> list[str] | None:
    """Make room for ``sum(sizes)`` bytes beside ``local`` and create the reserved partial
    files (their names carry their sizes), under the global lock. None: a prefetch that does
    not fit.

    Args:
        cache_dir: the cache folder.
        local: where the complete file will live.
        sizes: bytes of the file and of each companion.
        limit: the size limit given the bytes in use (``limit(used)``), or None for no limit
            (the folder is not even scanned).
        evict_file: deletes one unheld complete file, returning the bytes freed or None
            (:func:`evict`, plus the caller's accounting).
        prefetch: skip (return None) rather than exceed the limit.
    """
    os.makedirs(cache_dir, exist_ok=True)
    need = sum(sizes)
    gfd = os.open(os.path.join(cache_dir, _GLOBAL_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(gfd, fcntl.LOCK_EX)
        files = scan(cache_dir) if limit is not None else []
        used = sum(size for _, size, _ in files)
        cap = limit(used) if limit is not None else None
        if cap is not None:
            if used + need > cap:
                for victim, _, _ in sorted(
                    (f for f in files if f[2] is not None), key=lambda f: f[2] or 0.0
                ):
                    freed = evict_file(victim)
                    if freed is not None:
                        used -= freed
                        if used + need <= cap:
                            break
            if used + need > cap and prefetch:
                return None
        folder, name = os.path.split(local)
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


def scan(cache_dir: str) -> list[tuple[str, int, float | None]]:
    """Every file in the cache: (path, bytes counted, last use for complete files / None for
    partial ones). Partial files of dead processes are deleted. Companions count with their
    main file."""
    out: list[tuple[str, int, float | None]] = []
    try:
        folders = [e for e in os.scandir(cache_dir) if e.is_dir(follow_symlinks=False)]
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
            complete[e.name] = (st.st_size, st.st_atime)  # last use: see touch
        totals: dict[str, int] = {}
        for name, (size, _) in complete.items():
            owner = _companion_owner(name, complete)  # companions count with their file
            key = name if owner is None else owner
            totals[key] = totals.get(key, 0) + size
        for name, total in totals.items():
            out.append((os.path.join(folder.path, name), total, complete[name][1]))
    return out


def evict(local: str) -> int | None:
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
        logger.debug("evicted %s (%d bytes) from the shard cache", local, freed)
        return freed
    finally:
        os.close(fd)


def _try_lock(path: str, how: int) -> int | None:
    """:func:`_open_lock` without waiting: None when another process holds a conflicting
    lock."""
    try:
        return _open_lock(path, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return None


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


def touch(path: str) -> None:
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


def _companion_owner(name: str, names: Iterable[str]) -> str | None:
    for suffix in COMPANION_SUFFIXES:
        if name.endswith(suffix):
            owner = name[: -len(suffix)]
            if owner in names:
                return owner
    return None
