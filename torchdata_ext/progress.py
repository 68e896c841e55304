"""Progress of long waits (a shuffle-buffer fill, listing, counting, downloading).

A :class:`Progress` shows nothing while the wait is short. Once it has lasted ``delay``
seconds it shows a tqdm bar when stderr is a terminal (and ``bar`` allows it), else it logs
a line through the given logger at most every ``interval`` seconds, and a closing line when it
ends. Checking costs one clock read per :meth:`Progress.update`.
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Any

__all__ = ["DELAY_S", "INTERVAL_S", "Progress", "fsspec_callback"]

DELAY_S = 2.0  # a wait shorter than this shows nothing
INTERVAL_S = 10.0  # seconds between two log lines of one wait


def _clock() -> float:  # patched in tests
    return time.monotonic()


class Progress:
    """Count the steps of one long wait and report them once it has lasted ``delay`` seconds
    (at the next :meth:`update`, or at :meth:`close` for a wait of one long step).

    Args:
        what: what is being waited for, e.g. ``"filling the shuffle buffer"``.
        logger: where log lines go (the calling module's logger).
        total: the expected number of steps (items, files, bytes); None if unknown.
        unit: the name of a step (``"sequences"``, ``"files"``, ``"B"``).
        bar: True: a tqdm bar when stderr is a terminal, log lines otherwise; False: log lines
            only (use it in background threads and dataloader workers, whose bars would mix).
        delay: seconds of silence before the first report.
        interval: seconds between two log lines.
        level: the level of the progress lines (the closing line is INFO): WARNING for a
            wait the user must hear of even without a logging configuration.
    """

    def __init__(
        self,
        what: str,
        logger: logging.Logger,
        *,
        total: int | None = None,
        unit: str = "items",
        bar: bool = True,
        delay: float = DELAY_S,
        interval: float = INTERVAL_S,
        level: int = logging.INFO,
    ) -> None:
        self.what = what
        self.logger = logger
        self.total = total
        self.unit = unit
        self.done = 0
        self._bar_allowed = bar
        self._delay = delay
        self._interval = interval
        self._level = level
        self._t0 = _clock()
        self._last_log: float | None = None  # when the last line was logged; None: none yet
        self._bar: Any = None
        self._closed = False

    @property
    def shown(self) -> bool:
        """Whether anything was reported (the wait lasted ``delay`` seconds)."""
        return self._bar is not None or self._last_log is not None

    def update(self, n: int = 1) -> None:
        """``n`` more steps are done."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = _clock()
        if now - self._t0 < self._delay:
            return
        if self._last_log is None and self._bar_allowed and _terminal():
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total,
                initial=self.done,
                desc=self.what,
                unit=self.unit,
                unit_scale=self.unit == "B",
                file=sys.stderr,
                leave=False,
            )
            return
        if self._last_log is None or now - self._last_log >= self._interval:
            self._last_log = now
            self.logger.log(
                self._level,
                "%s: %s after %.0f s%s",
                self.what,
                self._count(),
                now - self._t0,
                self._eta(now),
            )

    def close(self, ok: bool = True) -> None:
        """The wait is over: a closing line if it lasted ``delay`` seconds and ``ok`` (it did
        not fail: the error says the rest)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elapsed = _clock() - self._t0
        if ok and elapsed >= self._delay and not self._closed:
            self.logger.info("%s: done, %s in %.1f s", self.what, self._count(), elapsed)
        self._closed = True

    def _eta(self, now: float) -> str:
        """``", about N s left"`` at the rate so far, when the total is known."""
        if not self.total or not self.done or self.done >= self.total:
            return ""
        left = (now - self._t0) * (self.total - self.done) / self.done
        return f", about {left:.0f} s left"

    def _count(self) -> str:
        if self.total is None:
            return f"{self.done:,} {self.unit}"
        return f"{self.done:,} of {self.total:,} {self.unit}"

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(ok=exc_type is None)


def fsspec_callback(progress: Progress, base: int = 0) -> Any:
    """An ``fsspec.callbacks.Callback`` for one transfer (e.g. ``fs.get_file(...,
    callback=...)``) that keeps ``progress.done`` at ``base`` plus the bytes transferred; a
    new one per attempt, so a retried transfer is not counted twice."""
    from fsspec.callbacks import Callback

    class _Bytes(Callback):
        def call(self, hook_name: str | None = None, **kwargs: Any) -> None:
            progress.update(base + int(self.value) - progress.done)

    return _Bytes()


def _terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
