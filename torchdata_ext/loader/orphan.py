"""A dataloader worker ends within about a second of its training process's death.

torch's worker loop notices a dead parent only while it waits for an index (every 5 s), and
then exits through ``multiprocessing``'s finalizers, which join the queue's feeder thread. When
the parent was killed (SIGKILL from the OOM killer or a preemption) while the worker's
messages filled the pipe (a message of this package carries a group of batches, often more
than the pipe's 64 KB), that thread waits forever to write to a pipe nobody reads: the worker
never exits and keeps its memory and shared-memory slots. :func:`exit_with_parent` starts a
daemon thread in the worker that checks the training process every ``interval`` seconds and
ends the worker at once (``os._exit``: no finalizer, no join) when it is gone, after removing
the worker's ``multiprocessing`` temporary folder (the one finalizer it needs: a worker that
sent shared-memory tensors keeps a socket there).

The training process is named by its pid (taken where the dataset was made), not found as the
worker's parent: with ``multiprocessing_context="forkserver"`` the parent is the fork server,
which outlives the trainer as long as any worker runs (each worker holds the fd whose closing
tells the server to exit), so watching the parent alone would leave both waiting forever.
A changed parent (the worker reparented to init or a subreaper) counts as gone too.
"""

from __future__ import annotations

import multiprocessing.process
import os
import shutil
import sys
import threading
import time

__all__ = ["PARENT_CHECK_INTERVAL", "exit_with_parent"]

PARENT_CHECK_INTERVAL = 0.5  # seconds between checks of the parent (a getppid() call each)

_started_in: int | None = None  # the pid whose watchdog runs (a forked child starts its own)


def exit_with_parent(trainer: int, interval: float = PARENT_CHECK_INTERVAL) -> None:
    """In a dataloader worker: end this process within ``interval`` seconds (> 0) of the
    death of the training process ``trainer`` (its pid) or of this worker's parent.
    Idempotent per process."""
    global _started_in
    if interval <= 0:
        raise ValueError(f"{interval=} must be > 0 seconds")
    pid = os.getpid()
    if _started_in == pid:
        return
    _started_in = pid
    parent = os.getppid()
    threading.Thread(
        target=_watch,
        args=(trainer, parent, interval, _mp_temp_dir()),
        name="exit_with_parent",
        daemon=True,
    ).start()


def _mp_temp_dir() -> str | None:
    """This process's ``multiprocessing`` temporary folder (``pymp-*``, where a worker that
    sends shared-memory tensors keeps its resource sharer's socket), None until one is made.
    A forked process starts with its parent's, if the parent had made one."""
    config = getattr(multiprocessing.process.current_process(), "_config", None)
    folder = config.get("tempdir") if isinstance(config, dict) else None
    return folder if isinstance(folder, str) else None


def _drop_temp_dir(inherited: str | None, trainer: int) -> None:
    """Remove the ``multiprocessing`` temporary folder before ``os._exit`` (which skips the
    finalizer that would): the worker's own, or the one it shares with ``trainer`` (made
    before the fork) once the trainer is gone."""
    folder = _mp_temp_dir()
    if folder is not None and (folder != inherited or _gone(trainer)):
        shutil.rmtree(folder, ignore_errors=True)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie not yet reaped counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's (the pid was reused)
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:  # no /proc (not Linux): os.kill said it is there
        return False


def _watch(trainer: int, parent: int, interval: float, inherited: str | None) -> None:
    while True:
        time.sleep(interval)
        if os.getppid() != parent or _gone(trainer):
            try:
                sys.stderr.write(
                    f"torchdata_ext: dataloader worker {os.getpid()} exits: its training "
                    f"process (pid {trainer}) is gone\n"
                )
                sys.stderr.flush()
                _drop_temp_dir(inherited, trainer)
            finally:
                os._exit(1)
