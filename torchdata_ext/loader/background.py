"""Run an iterator in a daemon thread, a few items ahead: how ``TokenLoader`` keeps the
training thread free (it only takes finished batches).

The hand-over is batched. A consumer that finds nothing ready sleeps until ``wake`` items
are (or ``linger``, 5 ms, passed with at least one ready, or the source ended), and a
producer that found the buffer full sleeps until ``wake`` places are free. Waking a sleeping
thread costs the running one more than the item: the woken thread takes the interpreter lock
from it, across cores. Measured with a consumer that only takes the batches (3 x 256 shards,
~0.4 ms a batch): one wake-up per batch ran the pipeline at ~0.78x of its own rate in one
thread, several per wake-up at ~0.83x. A consumer that calls torch between batches hands the
lock over anyway (torch releases it in every call: that is what lets this thread run during a
training step), and one that never catches up with the producer never sleeps; for both
nothing changes.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = ["Background"]


class Background(Iterator[Any]):
    """Run an iterator in a daemon thread, up to ``depth`` items ahead; the source's
    exceptions are raised in the consumer, after the items before them.

    Args:
        source: the iterator to run.
        depth: items prepared ahead at most.
        wake: a consumer that found nothing ready is woken when this many items are (default
            ``depth // 2``).
        linger: seconds between the looks of a waiting consumer at what is ready, so an item
            is never held back longer than that for the rest of its hand-over (a source that
            stalls, e.g. on a download).
    """

    _END = object()

    def __init__(
        self, source: Iterator[Any], depth: int, wake: int | None = None, linger: float = 0.005
    ) -> None:
        if depth < 1:
            raise ValueError(f"{depth=} must be >= 1")
        self._depth = depth
        self._linger = linger
        self._wake = max(1, min(depth, wake if wake is not None else depth // 2))
        self._items: collections.deque[Any] = collections.deque()
        lock = threading.Lock()
        self._ready = threading.Condition(lock)  # the consumer waits on it
        self._room = threading.Condition(lock)  # the producer waits on it
        self._consumer_waits = False
        self._producer_waits = False
        self._finished = False  # the producer put its last item (end or exception)
        self._stop = False
        self._done = False
        self._thread = threading.Thread(
            target=self._run, args=(source,), name="TokenLoader", daemon=True
        )
        self._thread.start()

    def _run(self, source: Iterator[Any]) -> None:
        last: Any = self._END
        try:
            for item in source:
                if not self._put(item):
                    break
        except BaseException as exc:  # handed to the consumer
            last = _Raised(exc)
        with self._ready:  # after close() too: a consumer still waiting then stops
            self._items.append(last)
            self._finished = True
            self._ready.notify()

    def _put(self, item: Any) -> bool:
        """Append ``item``; False when closed."""
        items = self._items
        with self._ready:
            if self._stop:
                return False
            items.append(item)
            if self._consumer_waits and len(items) >= self._wake:
                self._ready.notify()
            while len(items) >= self._depth and not self._stop:
                if self._consumer_waits:  # full: what is here is all it can get
                    self._ready.notify()
                self._producer_waits = True
                self._room.wait()
            self._producer_waits = False
            return not self._stop

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        items = self._items
        with self._ready:
            if not items:
                self._consumer_waits = True
                try:
                    while len(items) < self._wake and not self._finished:
                        if items and self._producer_waits:
                            break
                        # woken at `wake` items, else every `linger` to take what is ready
                        if not self._ready.wait(self._linger) and items:
                            break
                finally:
                    self._consumer_waits = False
            if not items:  # closed: close() dropped the rest, the end included
                self._done = True
                raise StopIteration
            item = items.popleft()
            if self._producer_waits and len(items) <= self._depth - self._wake:
                self._room.notify()
        if item is self._END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Raised):
            self._done = True
            raise item.exc
        return item

    def close(self) -> None:
        """Stop the thread at its next item (it is a daemon: it ends with the process in any
        case) and drop what it prepared."""
        with self._ready:
            self._stop = True
            self._items.clear()
            self._room.notify()
        # the last reference to the loader may go away in this thread itself (its source is
        # the loader's generator): then there is nothing to wait for
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)


class _Raised(NamedTuple):
    """An exception of the source, handed to the consumer."""

    exc: BaseException
