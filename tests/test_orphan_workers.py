"""A training process killed by SIGKILL (the OOM killer, a preemption) leaves no dataloader
worker running: each exits within seconds, whatever it was blocked on (loader/orphan.py);
and no file of the loader's in the temporary folder."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from torchdata_ext.testing import write_arrow_batches

HERE = os.path.dirname(os.path.abspath(__file__))
_COUNTS_CACHE = f"torchdata_ext_cache_{os.getuid()}"  # the index's counts, kept across runs


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(name))
    return out


def _descendants(pid: int) -> set[int]:
    children, out, todo = _children(), set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _cpu_ticks(pids: set[int]) -> int:
    """The CPU time (user + system, in clock ticks) the processes ``pids`` have used so far."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


def _wait_until_idle(pid: int, quiet_s: float = 0.5, at_most_s: float = 10.0) -> set[int]:
    """The descendants of ``pid`` once they have used no CPU for ``quiet_s`` seconds (the
    workers have filled the pipe, or the ring, and wait on it), at most ``at_most_s``."""
    deadline = time.monotonic() + at_most_s
    procs, ticks, since = _descendants(pid), -1, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = _descendants(pid)
        used = _cpu_ticks(now)
        if now != procs or used != ticks:
            procs, ticks, since = now, used, time.monotonic()
        elif len(procs) >= 2 and time.monotonic() - since >= quiet_s:
            break
    return procs


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.multiprocess
# default: the workers are the trainer's children (fork); forkserver: its fork server's, which
# outlives the trainer while a worker runs (spawn: the trainer's children, as with fork)
# tokens in the messages fill the pipe (the hang); in the shared-memory ring (the default) each
# worker keeps a socket in a temporary folder of its own, which it removes as it exits
@pytest.mark.parametrize(
    "context, tokens", [("default", "messages"), ("forkserver", "messages"), ("default", "ring")]
)
def test_workers_exit_when_their_trainer_is_killed(tmp_path, context: str, tokens: str) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(5, 999, 4_000, dtype=np.uint32) for _ in range(400)]
    write_arrow_batches(str(tmp_path / "web" / "p0.arrow"), docs)
    # the trainer's temporary folder, so what its death leaves there can be listed and removed
    # instead of piling up in the machine's /tmp (short: a fork server's socket path in it must
    # fit AF_UNIX's 108 bytes, which the test's own folder under pytest-xdist does not)
    scratch = Path(tempfile.mkdtemp(prefix="orphan-"))
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "_orphan_trainer.py"), str(tmp_path), context, tokens],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    workers: set[int] = set()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        # the workers fill the pipe meanwhile, then wait on it (a fixed 2 s here before)
        workers = _wait_until_idle(proc.pid)
        assert len(workers) >= 2, workers  # the 2 workers (and a fork server's processes)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.1)
        left = [p for p in workers if _alive(p)]
        assert not left, f"processes {left} outlived their killed trainer by 10 s"
        # nothing of the loader's or its workers' is left in the temporary folder (the
        # persistent counts cache aside); a fork server's listening socket (the trainer's
        # pymp-* folder, which only the trainer's exit removes) is CPython's, and stays in the
        # scratch folder a launcher gives a job
        files = sorted(p.name for p in scratch.iterdir() if p.name != _COUNTS_CACHE)
        expected = 1 if context == "forkserver" else 0  # 0: a Python with abstract sockets
        assert len(files) <= expected and all(n.startswith("pymp-") for n in files), files
    finally:
        proc.kill()
        for p in _descendants(proc.pid) | workers:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        shutil.rmtree(scratch, ignore_errors=True)
