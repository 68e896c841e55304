"""The ``torchdata_ext.remote`` package surface, and the guarantee of ``write_bytes_atomic``
(the project's one atomic write): a failed write leaves the old file and no temporary file; a
killed writer leaves the old file or the new one, whole, never a part."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

import torchdata_ext.remote as remote
from torchdata_ext.remote import read_bytes, write_bytes_atomic


def test_the_package_exports_what_the_module_did() -> None:
    before_the_split = (
        "RemoteError RetryPolicy ShardCache check_access is_remote is_transient read_bytes "
        "with_retries write_bytes_atomic"
    )
    assert remote.__all__ == before_the_split.split()
    # public names outside __all__ are still importable from the package
    for name in [*remote.__all__, "RangeFile", "default_cache_dir", "explain_error"]:
        assert getattr(remote, name) is not None, name
    assert ".offsets.npy" in remote.COMPANION_SUFFIXES


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch) -> None:
    target = tmp_path / "state.json"
    write_bytes_atomic(str(target), b"old")

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_bytes_atomic(str(target), b"new")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["state.json"]


_WRITER = """
import sys
from torchdata_ext.remote import write_bytes_atomic
target, size = sys.argv[1], int(sys.argv[2])
print("ready", flush=True)
k = 0
while True:
    write_bytes_atomic(target, bytes([k % 2 + 65]) * size)
    k += 1
"""


@pytest.mark.multiprocess
def test_a_killed_writer_leaves_a_whole_file(tmp_path) -> None:
    size = 4 << 20
    target = tmp_path / "part.bin"
    write_bytes_atomic(str(target), b"A" * size)
    for delay in (0.1, 0.3):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(target), str(size)], stdout=subprocess.PIPE
        )
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        data = read_bytes(str(target))
        assert len(data) == size and data in (b"A" * size, b"B" * size)
        # a kill may leave the hidden temporary file, never anything under the target's name
        leftovers = [n for n in os.listdir(tmp_path) if n != "part.bin"]
        assert all(n.startswith(".part.bin.tmp-") for n in leftovers), leftovers


# -- one reset in a forked child ----------------------------------------------------------------
def _free_for_another_thread(lock) -> bool:
    """Whether a thread other than this one can take ``lock`` (a re-entrant lock copied by the
    fork while the parent held it is taken by the parent's thread ident, maybe this one's)."""
    import threading

    got: list[bool] = []

    def take() -> None:
        got.append(lock.acquire(timeout=2))
        if got[0]:
            lock.release()

    t = threading.Thread(target=take)
    t.start()
    t.join()
    return got == [True]


def _after_fork_report(cache, queue) -> None:
    from torchdata_ext.remote import process_state as ps

    queue.put(
        {
            "filesystems": dict(ps.FILESYSTEMS.items),
            "probe_clients": dict(ps.PROBE_CLIENTS.items),
            "probed_stores": dict(ps.PROBED_STORES.items),
            "locked": [
                r.lock.locked() for r in (ps.FILESYSTEMS, ps.PROBE_CLIENTS, ps.PROBED_STORES)
            ],
            # read before any call of the cache's own: the reset ran at the fork
            "cache_pid": cache._rt.pid,
            "cache_downloads": cache._rt.stats["downloads"],
            "cache_locked": not _free_for_another_thread(cache._rt.mu),
            "pid": os.getpid(),
        }
    )


def test_a_forked_child_starts_with_the_remote_globals_reset(tmp_path) -> None:
    """Filesystems, probe clients and a cache's per-process part, with every lock held by the
    parent at the fork: the child has none of the objects and free locks; the stores that
    answered the probe are still known."""
    import multiprocessing

    from torchdata_ext.remote import ShardCache
    from torchdata_ext.remote import process_state as ps
    from torchdata_ext.remote.files import private_filesystem

    private_filesystem(str(tmp_path / "x"), {}, own_retries=True)
    ps.PROBE_CLIENTS.setdefault("s3|client", object())  # as the probe keeps its S3 clients
    ps.PROBED_STORES.setdefault("s3|bucket|...", True)
    cache = ShardCache(tmp_path / "cache")
    rt = cache._runtime()
    rt.stats["downloads"] = 3
    assert ps.FILESYSTEMS.items and ps.PROBE_CLIENTS.items
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    held = [ps.FILESYSTEMS.lock, ps.PROBE_CLIENTS.lock, ps.PROBED_STORES.lock, rt.mu]
    for lock in held:  # as a parent thread in the middle of a call would
        lock.acquire()
    try:
        child = ctx.Process(target=_after_fork_report, args=(cache, queue))
        child.start()
        got = queue.get(timeout=60)
        child.join(timeout=60)
    finally:
        for lock in held:
            lock.release()
    assert child.exitcode == 0
    assert got["filesystems"] == {} and got["probe_clients"] == {}
    assert (
        got["probed_stores"] == ps.PROBED_STORES.items and "s3|bucket|..." in got["probed_stores"]
    )
    assert got["locked"] == [False, False, False] and not got["cache_locked"]
    assert got["cache_pid"] == got["pid"] != os.getpid() and got["cache_downloads"] == 0
    assert ps.FILESYSTEMS.items and ps.PROBE_CLIENTS.items  # the parent keeps its own
    assert cache._rt is rt and rt.stats["downloads"] == 3
    ps.PROBED_STORES.items.pop("s3|bucket|...")
    ps.PROBE_CLIENTS.items.pop("s3|client")


def test_the_store_probe_is_one_get_not_a_list(s3) -> None:
    """A process's first use of a store sends one GET of an absent key (not a LIST: every rank
    and worker probes once), and nothing the next time; a missing bucket is still named."""
    from collections import Counter

    from torchdata_ext.remote import RemoteError
    from torchdata_ext.remote import process_state as ps
    from torchdata_ext.remote.counting import count_s3_requests
    from torchdata_ext.remote.urls import filesystem

    ps.PROBED_STORES.items.clear()
    with count_s3_requests() as first:
        filesystem(s3.url("data", "p0.arrow"), s3.storage_options)
    with count_s3_requests() as again:
        filesystem(s3.url("data", "p1.arrow"), s3.storage_options)
    assert (first, again) == (Counter({"GET": 1}), Counter())
    with pytest.raises(RemoteError, match=r"^s3://no-such-bucket-x/d: access failed: the bucket"):
        filesystem("s3://no-such-bucket-x/d", s3.storage_options)
