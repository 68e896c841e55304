"""The watch on stages that drop documents: a pipeline that can never yield fails instead of
hanging, and one that keeps almost nothing says so early.

A stage that may drop documents (the reader's ``min_length``, ``on_error="skip"`` and held-out
split; document filters and maps; ``chunk`` packing with ``drop_remainder``) tells its
:class:`DropWatch` how many documents it read and how many it kept. On an endless stream a
stage that keeps nothing would otherwise pull forever, with no batch, no error and no log.

* **Fail** (:class:`NothingKeptError`, a ``ValueError``) when ``max_dropped`` documents in a
  row were read and none kept (default :data:`DEFAULT_MAX_DROPPED`, one million: seconds of
  reading, far more than any sensible filter drops between two kept documents), or sooner
  when the run covers ``cycle`` documents, a full pass over everything this worker reads
  (twice its documents: the functions are deterministic, so a pass that kept nothing will
  never keep anything).
* **Warn** once (a log warning) when, after :data:`WARN_AFTER` documents, at most
  :data:`WARN_SHARE` of them were kept: a filter that selective is more often a bug than a
  choice.

Only an endless stream fails: a finite one (``epochs`` set) that keeps nothing simply ends.
``max_dropped=None`` turns the failure off (the warning stays). The counts are per worker and
since the stage was last reset; they are not part of any state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torchdata_ext.state.graph import graph_nodes

__all__ = [
    "DEFAULT_MAX_DROPPED",
    "WARN_AFTER",
    "WARN_SHARE",
    "DropWatch",
    "NothingKeptError",
    "readers_pass",
]

logger = logging.getLogger("torchdata_ext")

DEFAULT_MAX_DROPPED = 1_000_000
WARN_AFTER = 10_000
WARN_SHARE = 0.01


class NothingKeptError(ValueError):
    """A stage read many documents in a row and kept none: it would never yield."""


class DropWatch:
    """Counts one stage's documents read and kept; fails or warns (see the module docstring).

    Args:
        stage: the stage's description for messages (e.g. ``"dataset 'web': the transforms
            [...]"``).
        max_dropped: documents in a row read with none kept before failing; None: never fail.
        fix: what the user should do, appended to the error.
    """

    def __init__(self, stage: str, max_dropped: int | None, fix: str) -> None:
        self.stage, self.max_dropped, self.fix = stage, max_dropped, fix
        self.reset(endless=False)

    def reset(self, *, endless: bool, cycle: int | None = None, warn: bool = True) -> None:
        """Start counting again.

        Args:
            endless: whether the stage's input never ends (only then can it fail).
            cycle: documents in a full pass over what this worker reads (None: unknown).
            warn: whether to warn when almost everything is dropped (off where that is the
                point, e.g. the held-out side of an evaluation split).
        """
        self.endless, self.cycle = endless, cycle
        self.read = self.kept = self.run = 0
        self._warned = not warn

    def count(self, read: int, kept: int, why: Callable[[], str] | None = None) -> None:
        """``read`` documents came in, ``kept`` went out; ``why()`` details the drops for a
        message (e.g. which step dropped how many), called only for one.

        Raises:
            NothingKeptError: the run of documents read with none kept reached the limit.
        """
        self.read += read
        self.kept += kept
        self.run = 0 if kept else self.run + read
        limits = [n for n in (self.max_dropped, self.cycle) if n is not None]
        if self.run and self.endless and limits and self.run >= min(limits):
            reason = why() if why is not None else ""
            whole = self.cycle is not None and self.run >= self.cycle
            raise NothingKeptError(
                f"{self.stage}: {self.run:,} documents read in a row and none kept"
                f"{' (' + reason + ')' if reason else ''}"
                + (
                    ", a whole pass over this worker's data: nothing would ever come out"
                    if whole
                    else f" (the limit: max_dropped_documents={self.max_dropped:,}): the "
                    "pipeline would wait for a batch forever"
                )
                + f"; {self.fix}"
            )
        if not self._warned and self.read >= WARN_AFTER and self.kept <= WARN_SHARE * self.read:
            self._warned = True
            logger.warning(
                "%s: kept %s of the first %s documents read (%s); check it is meant to be "
                "this selective",
                self.stage,
                f"{self.kept:,}",
                f"{self.read:,}",
                why() if why is not None else "the rest dropped",
            )


def readers_pass(source: Any) -> tuple[bool, int | None]:
    """For the readers under node ``source`` (reset already): whether any is endless
    (``epochs=None``), and twice the documents they own (a full pass; None: no reader)."""
    readers = [n for n in graph_nodes(source) if hasattr(n, "owned_documents")]
    owned = sum(int(r.owned_documents) for r in readers)
    endless = any(getattr(r, "epochs", 1) is None for r in readers)
    return endless, (2 * owned if owned else None)
