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
