"""What a started ``TokenLoader`` runs (its background thread, its dataloader workers), and
how it is stopped when the loader is dropped without ``close()``.

A loader can end up in a reference cycle without anyone writing one: an exception caught
anywhere below ``iter(loader)`` (a side file that does not exist, a retried read) keeps its
frames, and each frame its caller's, up to the one holding the loader. Such a loader is
freed by the cyclic garbage collector, at whatever later moment it runs, and everything the
loader alone holds goes in the same collection. The collector clears the weak references
first: the dataloader's index queues then close (``multiprocessing``'s finalizers), and only
then does the dataloader iterator's ``__del__`` tell its workers to exit, through queues
that no longer deliver. Each worker waits for a message that never comes and torch waits
5 s per worker before it kills it: a random stall of the training loop, seconds long.

:class:`Running` is held by a ``weakref.finalize`` of the loader, not by the loader alone, so
nothing it holds is garbage when the loader is: its callback stops the thread and the
workers while their queues still work (milliseconds), whenever and however the loader goes.

A loader still alive when the interpreter exits is stopped by an ``atexit`` callback, before
the interpreter finalizes. Left running, its thread (a daemon) would go on into torch and
NumPy calls that release the interpreter lock; Python (3.11-3.13) ends a daemon thread that
takes the lock back during finalization with ``pthread_exit``, whose unwinding through a C++
frame of such a call ends the process in ``std::terminate`` ("terminate called without an
active exception", exit status -6): about 1 exit in 30 on a loaded machine, with 2 workers.
"""

from __future__ import annotations

import atexit
import multiprocessing.util  # noqa: F401 - its exit function is registered first, so runs last
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Running"]


class Running:
    """The background thread (a :class:`~torchdata_ext.loader.background.Background`, or
    None) and the dataloader iterator (whose ``_shutdown_workers`` ends its workers, or None)
    of a started loader. :meth:`stop` ends both, once."""

    def __init__(self) -> None:
        self.thread: Any = None
        self.workers: Any = None
        self.pid = os.getpid()  # a forked child has a copy, but neither the thread nor workers

    def stop(self) -> None:
        """Stop the thread at its next item and end the workers now."""
        thread, self.thread = self.thread, None
        workers, self.workers = self.workers, None
        if thread is not None:
            thread.close()
        shutdown = getattr(workers, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()

    def stop_when_freed(self, owner: object) -> None:
        """:meth:`stop` when ``owner`` is freed (by reference count or by the cyclic
        collector), or at the interpreter's exit before it finalizes (stopping them while it
        finalizes can end it in ``std::terminate``, torch's threads)."""
        weakref.finalize(owner, _stop_unless_finalizing, self).atexit = False
        _LIVE.add(self)


_LIVE: weakref.WeakSet[Running] = weakref.WeakSet()  # of loaders not freed yet


@atexit.register
def _stop_at_exit() -> None:
    """Stop every loader still alive while the interpreter can still run its threads
    (``atexit`` callbacks run before finalization, last registered first: this one before
    ``multiprocessing``'s, which ends the daemonic worker processes)."""
    for running in list(_LIVE):
        if running.pid == os.getpid():
            running.stop()


def _stop_unless_finalizing(
    running: Running, _finalizing: Callable[[], bool] = sys.is_finalizing
) -> None:
    # bound as a default argument: at interpreter shutdown the module's globals may be gone
    if not _finalizing() and running.pid == os.getpid():
        running.stop()
