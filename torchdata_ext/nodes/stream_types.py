"""The types Pack's input side passes between its parts (see :mod:`.stream`).

A :class:`Stream` is one upstream block with its document specials placed; a strategy takes
its tokens ``a .. b`` as a :data:`StreamPart`; :class:`Units` is how a block is laid out (what
the mix's mirror of Pack's cursor needs to know where rows end); :class:`Specials` the token ids
Pack places; :class:`ReplayMark` the clean point a restore replays from.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from torchdata_ext.document import DocumentBlock

__all__ = [
    "LazyState",
    "ReplayMark",
    "SlicedStream",
    "Specials",
    "Stream",
    "StreamPart",
    "StreamPiece",
    "Units",
    "marks_any",
    "row_offsets",
]


class LazyState:
    """An upstream state taken at a pull, made into the state dict only when asked for:
    ``make(*args)``, once (:meth:`resolve`). A source offers them with ``state_at_pull()``
    (``Interleave``); :meth:`StreamCursor.here <torchdata_ext.nodes.stream.StreamCursor.here>`
    resolves the one of the block a saved state replays from."""

    __slots__ = ("_args", "_make", "_state")

    def __init__(self, make: Any, args: tuple[Any, ...]) -> None:
        self._make, self._args, self._state = make, args, None

    def resolve(self) -> Any:
        if self._state is None:
            self._state, self._args = self._make(*self._args), ()
        return self._state


StreamPiece = tuple[
    str, int, int, int, int
]  # (dataset, file, doc, start, stop) of a document piece


@dataclass
class Stream:
    """One upstream block with its document specials placed.

    ``tokens`` is the block's tokens with BOS/EOS inserted, ``rows`` its provenance rows in
    stream order (``row_off`` their token offsets, ``len(rows) + 1``), and ``unit_off`` the token
    offsets of each piece's unit (``len(block) + 1``). A stream cut from a whole block's
    (``parent``) takes its rows from it, when they are first asked for.
    """

    pre_state: Any  # the upstream state from which the next pull gives this block
    carry_in: list[list[Any]]  # open documents that began with the shared BOS/EOS token
    tokens: np.ndarray
    own_rows: np.ndarray | None  # rows (None: not taken from the parent yet)
    own_row_off: np.ndarray | None  # row_off (None with own_rows)
    unit_off: np.ndarray
    # where document runs start (stream token offsets), as Layout.layout would cut the stream
    # read in one piece; built on first use by Layout.runs
    run_at: list[int] | None = None
    _row_off: list[int] | None = None  # row_off as a list, for bisect
    unit_last: np.ndarray | None = None  # whether each unit ends its document (bool)
    _doc_ends: np.ndarray | None = None  # stream token offsets where documents end, cached
    # the block each unit is a piece of (file, doc, start, length arrays) and which units got
    # a BOS / an EOS placed (None: none did): what a hand-back needs to report exactly
    block: DocumentBlock | None = None
    unit_bos: np.ndarray | None = None
    unit_eos: np.ndarray | None = None
    no_bos_in: list[list[Any]] | None = None  # the cursor's no-BOS documents before this block
    bos_skipped: frozenset[int] = frozenset()  # units whose BOS was delivered before a rescale
    # stream offsets of units a rescale handed back from inside their document: each starts
    # a row (see ConcatPad); None when the cursor lets them go on mid-row (continue_mid_row)
    pin_at: list[int] | None = None
    # (the stream of the whole block this one was cut from, the offset of this one in it):
    # its rows and Layout.runs's document runs are the whole stream's, sliced
    parent: tuple[Stream, int] | None = None

    @property
    def rows(self) -> np.ndarray:
        """The provenance rows in stream order (``(k, 5)``)."""
        if self.own_rows is None:
            self._rows_from_parent()
        assert self.own_rows is not None
        return self.own_rows

    @property
    def row_off(self) -> np.ndarray:
        """The stream token offsets of :attr:`rows` (``len(rows) + 1``)."""
        if self.own_row_off is None:
            self._rows_from_parent()
        assert self.own_row_off is not None
        return self.own_row_off

    def _rows_from_parent(self) -> None:
        assert self.parent is not None, "a stream without rows must have a parent"
        whole, at = self.parent
        b = at + len(self.tokens)
        rows = whole.rows_between(at, b) if b > at else whole.rows[:0].copy()
        self.own_rows, self.own_row_off = rows, row_offsets(rows)

    def doc_ends(self) -> np.ndarray:
        """The stream token offsets where documents end (after their EOS), ascending."""
        ends = self._doc_ends
        if ends is None:
            last = np.ones(self.n_units, bool) if self.unit_last is None else self.unit_last
            ends = self._doc_ends = self.unit_off[1:][last]
        return ends

    @property
    def n_units(self) -> int:
        """The number of units (pieces of the block)."""
        return len(self.unit_off) - 1

    def starts_with_literal(self, a: int) -> bool:
        """Whether stream token ``a`` is a placed special token."""
        if self.parent is not None:
            whole, at = self.parent
            return whole.starts_with_literal(at + a)
        return bool(self.rows[int(np.searchsorted(self.row_off, a, "right")) - 1, 0] < 0)

    def rows_between(self, a: int, b: int) -> np.ndarray:
        """Provenance rows of stream tokens ``a .. b`` (``a < b``)."""
        if self.parent is not None:  # the same rows, cut the same way
            whole, at = self.parent
            return whole.rows_between(at + a, at + b)
        row_off = self._row_off
        if row_off is None:
            row_off = self._row_off = self.row_off.tolist()
        r0 = bisect.bisect_right(row_off, a) - 1
        r1 = bisect.bisect_left(row_off, b)
        out = self.rows[r0:r1].copy()
        cut = a - row_off[r0]
        if cut:  # only document rows are longer than 1, so only they are ever cut
            out[0, 3] += cut
            out[0, 4] -= cut
        over = row_off[r1] - b
        if over:
            out[-1, 4] -= over
        return out


MaybeMask = np.ndarray | None  # a per-piece bool mask, or None when it marks none


class SlicedStream(Stream):
    """The stream of a run cut from a whole block's stream (``parent``): stream tokens ``a ..
    b`` of it, for pieces ``lo .. hi`` of the whole block from token ``skip`` of piece ``lo``
    and ``cut`` tokens of piece ``hi``. Equal to laying the run out on its own, field by
    field; its unit arrays (which ``concat`` packing never reads) are sliced from the whole
    stream's when first asked for, and its rows, as any child stream's, from the parent's."""

    @classmethod
    def cut(
        cls,
        whole: Stream,
        pre_state: Any,
        a: int,
        b: int,
        block: DocumentBlock,
        no_bos_in: list[list[Any]],
        spec: tuple[int, int, int, int],
    ) -> SlicedStream:
        """The run ``spec`` = ``(lo, skip, hi, cut)`` of ``whole``, at its stream tokens ``a
        .. b``; ``block`` is the run as a block."""
        out = cls.__new__(cls)
        out.__dict__.update(
            pre_state=pre_state, carry_in=[], tokens=whole.tokens[a:b], own_rows=None,
            own_row_off=None, run_at=None, _row_off=None, _doc_ends=None, block=block,
            no_bos_in=no_bos_in, bos_skipped=frozenset(), pin_at=None, parent=(whole, a),
            _spec=spec, _units=None,
        )  # fmt: skip
        return out

    def _sliced_units(self) -> tuple[np.ndarray, MaybeMask, MaybeMask, MaybeMask]:
        units: tuple[np.ndarray, MaybeMask, MaybeMask, MaybeMask] | None = self.__dict__["_units"]
        if units is not None:
            return units
        lo, skip, hi, cut = self.__dict__["_spec"]
        whole, a = self.__dict__["parent"]
        end = hi + 1 if cut else hi  # the pieces: lo .. end
        unit_off = whole.unit_off[lo : end + 1] - a
        unit_off[0], unit_off[-1] = 0, len(self.tokens)
        last = whole.unit_last
        if last is not None:
            last = last[lo:end].copy()
            if cut:
                last[-1] = False
        addbos, addeos = whole.unit_bos, whole.unit_eos
        if addbos is not None:
            addbos = addbos[lo:end].copy()
            if skip:
                addbos[0] = False
        if addeos is not None:
            addeos = addeos[lo:end].copy()
            if cut:
                addeos[-1] = False
        units = self.__dict__["_units"] = (unit_off, last, marks_any(addbos), marks_any(addeos))
        return units

    @property
    def unit_off(self) -> np.ndarray:  # type: ignore[override]
        return self._sliced_units()[0]

    @property
    def unit_last(self) -> np.ndarray | None:  # type: ignore[override]
        return self._sliced_units()[1]

    @property
    def unit_bos(self) -> np.ndarray | None:  # type: ignore[override]
        return self._sliced_units()[2]

    @property
    def unit_eos(self) -> np.ndarray | None:  # type: ignore[override]
        return self._sliced_units()[3]


def marks_any(mask: np.ndarray | None) -> np.ndarray | None:
    """``mask``, or None when it marks no piece."""
    return None if mask is None or not np.count_nonzero(mask) else mask


def row_offsets(rows: np.ndarray) -> np.ndarray:
    """The stream token offsets of provenance ``rows`` (``len(rows) + 1``, from 0)."""
    row_off = np.empty(len(rows) + 1, np.int64)
    row_off[0] = 0
    rows[:, 4].cumsum(out=row_off[1:])
    return row_off


StreamPart = tuple[Stream, int, int]  # stream tokens a .. b


class Units(NamedTuple):
    """How Pack lays out one block (:meth:`StreamCursor.units`): ``off``, the stream offsets
    of its units (``len(block) + 1``); ``bos``, 1 where a BOS is placed before the piece;
    ``pin_at``, the offsets of units that start a row whatever came before (None: none)."""

    off: np.ndarray
    bos: np.ndarray
    pin_at: list[int] | None


class Specials(NamedTuple):
    """The special token ids Pack places (see :class:`~torchdata_ext.nodes.pack.Pack`)."""

    bos: int | None
    eos: int | None
    bol: int | None
    eol: int | None
    pad: int

    @property
    def combined(self) -> bool:
        """One separator for both ends (epochraft): only an EOS is ever added."""
        return self.bos is not None and self.bos == self.eos

    @property
    def bos_role(self) -> int | None:
        """The id of an added BOS (None: none is ever added)."""
        return None if self.combined else self.bos


class ReplayMark(NamedTuple):
    """A clean point upstream to replay from (Pack's state keys of the same names).

    Attributes:
        source: the upstream state from which the next pull gives the block.
        consumed: what of that block is already used (stream tokens or units, by strategy).
        open_docs: ``[dataset, file, doc]`` of documents open at that block that began with
            the shared BOS/EOS token (the block's :attr:`Stream.carry_in`).
        bos_done: ``[dataset, file, doc]`` of documents whose BOS was already delivered
            although their first piece is still to come (a rescale handed the piece back
            after a row that ended with the BOS): they get no BOS again.
    """

    source: Any
    consumed: int
    open_docs: list[list[Any]]
    bos_done: list[list[Any]] = []
