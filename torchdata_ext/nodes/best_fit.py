"""Pack's ``best_fit`` mode: a window of units placed best-fit-decreasing into bins.

The strategy reads ``window`` pieces of the stream (:mod:`.stream`), cuts units longer than a
sequence into a head (the remainder, holding the document start) and full-sequence chunks,
places the items best-fit-decreasing (ties broken by arrival) into bins of one sequence (Ding
et al. 2024, "Fewer Truncations Improve Language Modeling") and emits the bins padded, one a
sequence::

    window (capacity 8)   a:5  b:3  c:6  d:2  e:10 -> e head 2 + chunk 8
    by size, then arrival e8 c6 a5 b3 d2 e2
    bins                  [e8] [c6 d2] [a5 b3] [e2]
    emitted, by earliest  |a b| |c d| |e2| |e8|   (pieces in a bin in arrival order)

Bins come out ordered by their earliest piece in arrival order, pieces inside a bin in arrival
order (a head that is only the BOS goes last, so it cannot be read as the start of the next).

State (Pack's keys): the window's first block (``source``, ``open_docs``), the units of it
before the window (``consumed``) and the bins of the window already emitted (``bins``). A
restore rebuilds the window from there and skips those bins.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from torchdata_ext.nodes.packed import Layout, PackedSequence
from torchdata_ext.nodes.stream import StreamCursor
from torchdata_ext.nodes.stream_types import ReplayMark, Stream, StreamPart, StreamPiece


class BestFit:
    """The ``best_fit`` packing strategy of :class:`~torchdata_ext.nodes.pack.Pack`.

    Args:
        cursor: Pack's upstream cursor (``pos`` counts units).
        layout: Pack's line layout.
        window: pieces per window.
        flush: at the end of the source, pack the last, incomplete window, else drop it.
    """

    def __init__(self, cursor: StreamCursor, layout: Layout, *, window: int, flush: bool):
        self._cursor = cursor
        self._layout = layout
        self._window = window
        self._flush = flush
        self._anchor = cursor.here()  # where the current window starts
        self._bins: list[list[StreamPart]] | None = None  # the current window's bins, once built
        self._bins_done = 0

    def reset(self, bins_done: int) -> None:
        """Start a window at the cursor, of which ``bins_done`` bins are already emitted."""
        self._anchor = self._cursor.here()
        self._bins, self._bins_done = None, bins_done

    def position(self) -> tuple[ReplayMark, int]:
        """Where the current window starts, and how many of its bins are emitted."""
        return self._anchor, self._bins_done

    def next_packed(self) -> PackedSequence:
        """The next bin as a sequence; ``StopIteration`` at the end of the source."""
        while self._bins is None:
            bins = self._build_window()
            if bins:
                self._bins = bins
            elif self._cursor.exhausted:
                raise StopIteration
            else:  # a window of empty documents only: the next window starts after it
                self._advance_anchor()
        if self._bins_done >= len(self._bins):
            raise ValueError(
                f"the restored window packs into {len(self._bins)} sequences but the checkpoint "
                f"had emitted {self._bins_done} of it: the data changed since the checkpoint"
            )
        parts = self._bins[self._bins_done]
        self._bins_done += 1
        if self._bins_done == len(self._bins):  # the next window starts at the cursor
            self._bins = None
            self._advance_anchor()
        return self._layout.emit(parts)

    def inflight(self) -> tuple[list[StreamPiece], list[list[Any]]]:
        """The pieces of the window's bins not yet emitted, then the rest of the block the
        window ended in (the window built again first after a restore), and the documents
        among them whose BOS was delivered (see :meth:`~.stream.StreamCursor.held`)."""
        c = self._cursor
        if self._bins is None and not c.exhausted:  # restored lazily: rebuild the window
            bins = self._build_window()
            if bins:
                self._bins = bins
        out: list[StreamPiece] = []
        bos_done: list[list[Any]] = []
        ranges = [part for parts in (self._bins or [])[self._bins_done :] for part in parts]
        cur = c.cur
        if cur is not None and c.pos < cur.n_units:
            ranges.append((cur, int(cur.unit_off[c.pos]), len(cur.tokens)))
        for s, a, b in ranges:
            got, done = c.held(s, a, b)
            out.extend(got)
            bos_done.extend(done)
        return out, bos_done

    def _advance_anchor(self) -> None:
        self._bins_done = 0
        self._anchor = self._cursor.here()

    def _build_window(self) -> list[list[StreamPart]]:
        """Read ``window`` pieces from the cursor on and place them into bins."""
        c = self._cursor
        segments: list[tuple[Stream, np.ndarray, np.ndarray]] = []  # units of each block
        need = self._window
        while need:
            if c.cur is None or c.pos >= c.cur.n_units:
                if not c.pull():
                    break
                continue
            s, lo = c.cur, c.pos
            hi = min(s.n_units, lo + need)
            a, b = s.unit_off[lo:hi], s.unit_off[lo + 1 : hi + 1]
            segments.append((s, a[b > a], b[b > a]))
            need -= hi - lo
            c.pos = hi
        if need and not self._flush:
            return []
        return _best_fit(segments, self._layout.capacity)


def _best_fit(
    segments: list[tuple[Stream, np.ndarray, np.ndarray]], cap: int
) -> list[list[StreamPart]]:
    """Best-fit-decreasing placement of a window's units (stream token ranges ``a .. b`` of
    each segment's stream) into bins of ``cap`` tokens; the bins as lists of parts."""
    if not segments:
        return []
    streams = [seg[0] for seg in segments]
    sid = np.concatenate([np.full(len(seg[1]), i, np.int64) for i, seg in enumerate(segments)])
    a = np.concatenate([seg[1] for seg in segments])
    b = np.concatenate([seg[2] for seg in segments])
    if not len(a):  # only empty documents
        return []
    # A long unit: a head of (length mod cap) tokens, then full-sequence chunks, each alone
    # in its bin. As the tail chunk is full, no piece is a lone EOS (which the layout, read
    # from provenance, would join to the document placed before it).
    head = (b - a) % cap
    n_items = (head > 0) + (b - a) // cap
    arrival = np.repeat(np.arange(len(a)), n_items)
    chunk = np.arange(len(arrival)) - np.repeat(np.cumsum(n_items) - n_items, n_items)
    a_i, head_i = np.repeat(a, n_items), np.repeat(head, n_items)
    has_head = head_i > 0
    is_head = has_head & (chunk == 0)
    lo = np.where(is_head, a_i, a_i + head_i + (chunk - has_head) * cap)
    size = np.where(is_head, head_i, cap)
    order = np.lexsort((chunk, arrival, -size))  # decreasing size, then arrival
    placed = np.empty(len(order), np.int64)
    placed[order] = _place(size[order].tolist(), cap)
    n_bins = int(placed.max()) + 1
    key = arrival * (int(chunk.max()) + 1) + chunk  # arrival order of the pieces
    first = np.full(n_bins, np.iinfo(np.int64).max)
    np.minimum.at(first, placed, key)
    rank = np.empty(n_bins, np.int64)
    rank[np.argsort(first)] = np.arange(n_bins)  # bins by their earliest piece
    # arrival order inside a bin, but a piece that is a lone BOS goes last: the layout
    # would join it to a following document that did not get a BOS (it began with one)
    lone = np.zeros(len(order), bool)
    for k in np.flatnonzero(size == 1).tolist():
        lone[k] = streams[sid[arrival[k]]].starts_with_literal(int(lo[k]))
    final = np.lexsort((key, lone, rank[placed]))
    parts = [
        (streams[t], x, x + n)
        for t, x, n in zip(sid[arrival[final]].tolist(), lo[final].tolist(), size[final].tolist())
    ]
    ends = np.cumsum(np.bincount(rank[placed], minlength=n_bins)).tolist()
    return [parts[e0:e1] for e0, e1 in zip([0, *ends[:-1]], ends)]


def _place(sizes: list[int], cap: int) -> list[int]:
    """Best fit, in the given order: each size into the fullest bin it fits (lowest bin id on
    ties), else a new bin. Returns the bin of each size."""
    free: list[int] = []  # sorted codes (room left << 32 | bin)
    out: list[int] = []
    n_bins = 0
    for size in sizes:
        j = bisect.bisect_left(free, size << 32)
        if j < len(free):
            code = free.pop(j)
            room, k = code >> 32, code & 0xFFFFFFFF
        else:
            room, k = cap, n_bins
            n_bins += 1
        out.append(k)
        if room > size:
            bisect.insort(free, ((room - size) << 32) | k)
    return out
