"""Run an iterator in a daemon thread, a few items ahead: how ``TokenLoader`` keeps the
training thread free (it only takes finished batches)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = ["Background"]


class Background(Iterator[Any]):
    """Run an iterator in a daemon thread, ``depth`` items ahead; its exceptions are raised
    in the consumer."""

    _END = object()

    def __init__(self, source: Iterator[Any], depth: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=self._run, args=(source,), name="TokenLoader", daemon=True
        )
        self._thread.start()

    def _run(self, source: Iterator[Any]) -> None:
        try:
            for item in source:
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as exc:  # handed to the consumer
            self._put(_Raised(exc))

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is self._END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Raised):
            self._done = True
            raise item.exc
        return item

    def close(self) -> None:
        self._stop.set()
        # the last reference to the loader may go away in this thread itself (its source is
        # the loader's generator): then there is nothing to wait for
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)  # a daemon: it ends at its next item or exit


class _Raised(NamedTuple):
    """An exception of the source, handed to the consumer."""

    exc: BaseException
