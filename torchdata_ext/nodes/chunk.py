"""Pack's ``chunk`` mode: each document cut into sequences of its own (epochraft's ``chunk``).

The strategy reads the stream (:mod:`.stream`) straight on, like ``concat``, but a sequence
never holds two documents: it ends at a document's end (after its EOS), and the document's
last, partial piece is padded, or dropped with ``drop_remainder``::

    stream   |B a a a a a a a a E| |B b b E|                capacity 4
    chunk    |B a a a| |a a a a| |a E P P| |B b b E|         (drop_remainder: |a E P P| dropped)

A document cut into pieces upstream (``max_chunksize``, or across blocks) is one document here:
its pieces arrive contiguous and in order (interleave keeps them so), and the sequences are cut
every ``capacity`` tokens from the document's start. The clean point to replay from is the
cursor itself (Pack's ``source`` / ``consumed`` keys), as for ``concat``: a dropped remainder is
passed over before the next sequence is emitted, so a state never stands inside one.

A piece made only of a placed BOS or EOS (a document whose tokens end exactly at a sequence's
end leaves its EOS alone) is never emitted, padded or not: it holds no document token, and a
rescale, which hands back document tokens only, could not tell whether it was delivered (the
new owner would emit it again). So the sequences after a rescale are exactly those of the
uninterrupted run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchdata_ext.nodes.drops import DropWatch
from torchdata_ext.nodes.packed import Layout, PackedSequence
from torchdata_ext.nodes.stream import StreamCursor
from torchdata_ext.nodes.stream_types import ReplayMark, StreamPart, StreamPiece


class Chunk:
    """The ``chunk`` packing strategy of :class:`~torchdata_ext.nodes.pack.Pack`.

    Args:
        cursor: Pack's upstream cursor (``pos`` counts stream tokens).
        layout: Pack's line layout.
        drop_remainder: drop each document's last sequence when it is not full, else pad it.
        flush: at the end of the source, emit a document's last partial sequence padded (if
            not ``drop_remainder``), else drop it.
        drops: counts the documents whose only sequence ``drop_remainder`` dropped (an endless
            source of documents shorter than a sequence would otherwise never give one).
    """

    def __init__(
        self,
        cursor: StreamCursor,
        layout: Layout,
        *,
        drop_remainder: bool,
        flush: bool,
        drops: DropWatch,
    ):
        self._cursor = cursor
        self._layout = layout
        self._drop_remainder = drop_remainder
        self._flush = flush
        self.drops = drops

    def reset(self, bins_done: int) -> None:
        """Start again at the cursor (``bins_done`` is a best-fit key: ignored)."""

    def position(self) -> tuple[ReplayMark, int]:
        """The clean point to replay from, and 0 sequences of a window emitted."""
        return self._cursor.here(), 0

    def next_packed(self) -> PackedSequence:
        """The next sequence; ``StopIteration`` at the end of the source."""
        capacity = self._layout.capacity
        while True:
            parts, filled, ran_out = self._fill(capacity)
            if filled <= 2 and not self._has_document_tokens(parts):
                if ran_out:  # only a placed BOS/EOS: no sequence (see the module docstring)
                    raise StopIteration
                continue
            if filled == capacity:
                self.drops.count(0, 1)
                return self._layout.emit(parts)
            if filled and not self._drop_remainder and (self._flush or not ran_out):
                return self._layout.emit(parts)  # a document's remainder, padded
            if ran_out:
                raise StopIteration
            self.drops.count(1, 0)  # a remainder dropped

    def _has_document_tokens(self, parts: list[StreamPart]) -> bool:
        return any(self._cursor.pieces(s, a, b) for s, a, b in parts)

    def inflight(self) -> tuple[list[StreamPiece], list[list[Any]]]:
        """The rest of the current block (pulled again first after a restore)."""
        return self._cursor.rest_of_block()

    def _fill(self, capacity: int) -> tuple[list[StreamPart], int, bool]:
        """Up to ``capacity`` stream tokens of one document from the cursor on.

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
            ends = s.doc_ends()
            k = int(np.searchsorted(ends, a, "right"))
            doc_ends_here = k < len(ends)
            e = int(ends[k]) if doc_ends_here else len(s.tokens)
            b = min(e, a + capacity - filled)
            parts.append((s, a, b))
            filled += b - a
            c.pos = b
            if doc_ends_here and b == e:
                break  # the document ends: never a second one in this sequence
        return parts, filled, False
