"""Pack's ``concat`` and ``pad`` modes: sequences filled from the stream in arrival order.

Both read the stream (:mod:`.stream`) straight on and never look back, so the clean point to
replay from is the cursor itself: the current block and the stream tokens of it already
packed (Pack's ``source`` / ``consumed`` state keys)::

    stream   |B a a a E| |B b b b E| |B c c c E|        capacity 7 (bol, eol around it)
    concat   |bol B a a a E B b eol| |bol b b E B c c c eol| ...   cut every 7 tokens
    pad      |bol B a a a E P P eol| |bol B b b b E P P eol| ...   whole units while they fit

In ``pad`` a unit longer than an empty sequence starts a new sequence and is split across
sequences. A piece that a rescale handed back from inside its document (a unit at one of the
stream's ``pin_at``) starts a new sequence, the one before it padded, where placed after
another document it could follow a piece with no separator (a budget's cut, or any document
when no EOS is configured). Where every document ends with its own EOS and the mix cuts at row
ends, Pack's cursor pins nothing (``StreamCursor.continue_mid_row``) and such a piece fills
the row like any other.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from torchdata_ext.nodes.packed import Layout, PackedSequence
from torchdata_ext.nodes.stream import StreamCursor
from torchdata_ext.nodes.stream_types import ReplayMark, StreamPart, StreamPiece


class ConcatPad:
    """The ``concat`` / ``pad`` packing strategy of :class:`~torchdata_ext.nodes.pack.Pack`.

    Args:
        cursor: Pack's upstream cursor (``pos`` counts stream tokens).
        layout: Pack's line layout.
        whole_units: ``pad`` (True) or ``concat`` (False).
        flush: at the end of the source, emit the last partial sequence padded, else drop it.
    """

    def __init__(self, cursor: StreamCursor, layout: Layout, *, whole_units: bool, flush: bool):
        self._cursor = cursor
        self._layout = layout
        self._whole_units = whole_units
        self._flush = flush

    def reset(self, bins_done: int) -> None:
        """Start again at the cursor (``bins_done`` is a best-fit key: ignored)."""

    def position(self) -> tuple[ReplayMark, int]:
        """The clean point to replay from, and 0 sequences of a window emitted."""
        return self._cursor.here(), 0

    def next_packed(self) -> PackedSequence:
        """The next sequence; ``StopIteration`` at the end of the source."""
        parts, filled, ran_out = self._fill(self._layout.capacity)
        if filled == 0 or (ran_out and not self._flush):
            raise StopIteration
        return self._layout.emit(parts)

    def inflight(self) -> tuple[list[StreamPiece], list[list[Any]]]:
        """The rest of the current block (pulled again first after a restore)."""
        return self._cursor.rest_of_block()

    def _fill(self, capacity: int) -> tuple[list[StreamPart], int, bool]:
        """Take up to ``capacity`` stream tokens from the cursor on (whole units in ``pad``).

        Returns the parts, their token count, and whether the source ran out meanwhile.
        """
        c = self._cursor
        parts: list[StreamPart] = []
        filled = 0
        while filled < capacity:
            while c.cur is None or c.pos >= len(c.cur.tokens):
                if not c.pull():
                    return parts, filled, True
            s, a = c.cur, c.pos
            space = capacity - filled
            if not self._whole_units:
                b = min(len(s.tokens), a + space)
            else:
                j = int(np.searchsorted(s.unit_off, a + space, "right")) - 1
                b = int(s.unit_off[j])
                if b <= a:  # the next unit (or what is left of it) does not fit
                    if filled:
                        break
                    b = a + space  # longer than an empty sequence: split it
            if s.pin_at is not None:  # a handed-back continuation starts its row
                i = bisect.bisect_left(s.pin_at, a)
                if i < len(s.pin_at) and s.pin_at[i] == a:
                    if filled:
                        break
                    i += 1
                if i < len(s.pin_at) and s.pin_at[i] < b:
                    b = s.pin_at[i]
            parts.append((s, a, b))
            filled += b - a
            c.pos = b
        return parts, filled, False
