"""Pack's input side: upstream blocks read into streams with the document specials placed.

Shared by the packing strategies (:mod:`.concat_pad`, :mod:`.best_fit`, :mod:`.chunk`). A
:class:`StreamCursor` pulls :class:`~torchdata_ext.document.DocumentBlock` s from Pack's source and
turns each into a :class:`Stream`: the block's tokens with the BOS/EOS each piece gets, its
provenance rows, and the token offsets of its units (a piece plus its specials)::

    block   pieces |a a a| |b b|        a: start of document A, b: end of document B
    stream  units  |B a a a| |b b E|    rows: BOS, A[0:3], B[5:7], EOS (one token each special)

A strategy takes stream tokens ``a .. b`` as *parts* (``(stream, a, b)``) and hands them to
:class:`~.packed.Layout` to make the sequence. The cursor also keeps the clean point a
restore replays from (:class:`ReplayMark`). The types are in :mod:`.stream_types`.

A run the mix cut from one of its sources' blocks (a :class:`~.row_cuts.RunBlock`, marked
``RUN_OF``) is a contiguous slice of that block's stream: a piece going on from a token has no
BOS, a piece cut before its end no EOS, and nothing else changes. So the cursor lays each
source block out once and slices its runs from it (:meth:`StreamCursor._slice`, a
:class:`~.stream_types.SlicedStream`: neither the run's own arrays nor its units are built on
this path unless something reads them), and the mix finds row ends and
moves its row position in that stream's offsets (:meth:`StreamCursor.span`), instead of
laying out each run, and the rest of the block at each run, again. Only when a block's layout
depends on more than the block (a shared BOS/EOS token, a rescale's delivered BOS pending, a
block handed back) is each run laid out on its own.

This module is 610 lines, over the ~500 of the style guide: turning a block into a stream
(:meth:`StreamCursor._expand`) is one hot path in named stages (which pieces get specials, the
stream tokens, the provenance rows, the units that start a row) that share the cursor's
open-document state (:meth:`StreamCursor.units` runs its stages without the tokens, for the
mix to cut at row ends), and the slices of it are the same layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.document import DocumentBlock
from torchdata_ext.nodes.row_cuts import RUN_OF
from torchdata_ext.nodes.stream_types import (
    LazyState,
    ReplayMark,
    SlicedStream,
    Specials,
    Stream,
    StreamPiece,
    Units,
    marks_any,
    row_offsets,
)
from torchdata_ext.provenance import LITERAL, PROV_COLUMNS, literal_code

# a block's tokens are copied piece by piece (a slice copy each, ~1 us) when its pieces are
# this long on average (tokens), else through a mask (~0.5 ns per token): measured on 60
# pieces of ~1,000 tokens, 68 us piece by piece against 39 us through the mask
_SLICE_COPY_TOKENS = 2048
# what a block's layout is kept under in the block's __dict__ (see _Pieces.of, StreamCursor._units);
# a block is not changed once made (cut_block and select make new ones)
_PIECES_MEMO = "_stream_pieces"
_UNITS_MEMO = "_stream_units"
_WHOLE_MEMO = "_stream_whole"  # a block's whole Stream, kept for the runs cut from it
_OWN_MEMO = "_stream_own"  # a block's own layout (StreamCursor.own_layout)
_TOKEN_OFFSETS_MEMO = "_stream_token_offsets"  # token_offsets(block)


class StreamCursor:
    """Where Pack reads upstream: the current :class:`Stream` and a position in it.

    Args:
        source: Pack's source node (yielding token ``DocumentBlock`` s); None for a mirror,
            which lays blocks out and never reads (the mix's, see
            :meth:`~torchdata_ext.nodes.interleave.Interleave.follow_rows`: the source holds
            its mirror, so a mirror holding the source would make a reference cycle, and a
            dropped pipeline's readers, files and blocks would wait for the cyclic collector).
        dtype: the integer dtype of the stream tokens.
        specials: the token ids to place (only BOS and EOS are placed here).

    Attributes:
        cur: the stream being read (None until the first pull after a reset).
        pos: the position in ``cur`` (a stream token or a unit, by strategy).
        exhausted: whether the source has run out.
        dataset_names: the dataset names met so far, indexed by provenance dataset ids.
    """

    def __init__(self, source: BaseNode | None, dtype: np.dtype, specials: Specials) -> None:
        self.source = source
        # a source that takes its state lazily (Interleave): most are never read
        self._state_at_pull = getattr(source, "state_at_pull", None)
        self.dtype = dtype
        self.bos_token, self.eos_token = specials.bos, specials.eos
        self._combined = specials.combined
        # what a layout depends on (the last: whether continuations are pinned to row starts)
        self._key: tuple[Any, ...] = (specials.bos, specials.eos, np.dtype(dtype).str, True)
        self._bos_row = np.array([LITERAL, specials.bos or 0, 0, 0, 1], np.int64)
        self._eos_row = np.array([LITERAL, specials.eos or 0, 0, 0, 1], np.int64)
        self.dataset_names: list[str] = []
        self._ds_ids: dict[str, int] = {}
        self._open: set[tuple[str, int, int]] = set()
        self._no_bos: set[tuple[str, int, int]] = set()
        self._no_bos_list: list[list[Any]] = []  # _no_bos as the state lists it
        self.cur: Stream | None = None
        self.pos = 0
        self.exhausted = False
        self._skip = 0
        self._start = ReplayMark(None, 0, [])
        self.pin_continuations = True

    def continue_mid_row(self) -> None:
        """Let a handed-back continuation (and a document whose BOS was delivered before a
        rescale) go on mid-row after the document before it, instead of starting a row of its
        own (the row before it padded). Pack calls this when the mix cuts documents at row
        ends and every document end gets its EOS (a separate one), so what comes before such
        a piece in a row always ends with an EOS; without an EOS, or after a budget's cut
        (no EOS), the piece would be glued to the one before it, so it keeps its row start."""
        self.pin_continuations = False
        self._key = (*self._key[:3], False)

    def reset(self, start: ReplayMark, dataset_names: list[str]) -> None:
        """Read again from ``start`` (the source already reset to ``start.source``)."""
        self.cur, self.pos, self.exhausted = None, 0, False
        self._start = start
        self.dataset_names = dataset_names
        self._ds_ids = {n: i for i, n in enumerate(dataset_names)}
        self._open = {(str(d), int(f), int(k)) for d, f, k in start.open_docs}
        self._no_bos = {(str(d), int(f), int(k)) for d, f, k in start.bos_done}
        self._no_bos_list = start.bos_done
        self._skip = start.consumed

    def here(self) -> ReplayMark:
        """The clean point of the current position: the current block and ``pos`` in it."""
        if self.cur is None:
            return self._start
        pre = self.cur.pre_state
        if type(pre) is LazyState:
            pre = self.cur.pre_state = pre.resolve()
        return ReplayMark(pre, self.pos, self.cur.carry_in, self.cur.no_bos_in or [])

    def pull(self) -> bool:
        """Read the next block into ``cur``; False when the source is exhausted."""
        if self.exhausted:
            return False
        if self.source is None:
            raise RuntimeError("this StreamCursor is a mirror (no source): it never reads")
        pre = self._state_at_pull() if self._state_at_pull else self.source.state_dict()
        try:
            block = next(self.source)
        except StopIteration:
            self.exhausted = True
            return False
        self.cur = self._expand(block, pre)
        self.pos, self._skip = self._skip, 0
        return True

    def rest_of_block(self) -> tuple[list[StreamPiece], list[list[Any]]]:
        """What the current block holds not yet used (the block is pulled again first after a
        restore, skipping what was used): a strategy's pieces in flight, as :meth:`held`."""
        if self.cur is None and not self.exhausted:
            self.pull()
        cur = self.cur
        if cur is None or self.pos >= len(cur.tokens):
            return [], []
        return self.held(cur, self.pos, len(cur.tokens))

    def held(self, s: Stream, a: int, b: int) -> tuple[list[StreamPiece], list[list[Any]]]:
        """What stream tokens ``a .. b`` hold, for a hand-back that keeps the specials exact.

        Returns the pieces ``(dataset, file, doc, start, stop)`` to hand back, and the
        ``[dataset, file, doc]`` of documents whose piece from 0 is handed back but whose BOS
        lies before ``a`` (it was delivered: the new owner must not place it again). A
        document whose EOS lies in the range but none of its tokens (the row before ended
        with its last token) is handed back as the empty last piece ``(end, end)``, which gets
        just the EOS; a BOS alone in the range, as the empty first piece ``(0, 0)``.
        """
        if a >= b or s.block is None:
            return [], []
        blk = s.block
        name = blk.dataset
        uo = s.unit_off
        u0 = max(int(np.searchsorted(uo, a, "right")) - 1, 0)
        u1 = int(np.searchsorted(uo, b, "left"))
        pieces: list[StreamPiece] = []
        bos_done: list[list[Any]] = []
        lengths = blk.lengths
        for u in range(u0, min(u1, s.n_units)):
            lo, hi = int(uo[u]), int(uo[u + 1])
            if lo == hi:
                continue  # an empty whole document: no tokens, no specials
            bos = bool(s.unit_bos[u]) if s.unit_bos is not None else False
            skipped = u in s.bos_skipped
            eos = bool(s.unit_eos[u]) if s.unit_eos is not None else False
            dlo, dhi = lo + bos, hi - eos
            x, y = max(a, dlo), min(b, dhi)
            f, d, st0 = int(blk.file[u]), int(blk.doc[u]), int(blk.start[u])
            if x < y:
                start = st0 + x - dlo
                pieces.append((name, f, d, start, start + y - x))
                if (bos and x == dlo and lo < a) or (skipped and x == dlo):
                    bos_done.append([name, f, d])
            elif eos and a <= hi - 1 < b:
                end = st0 + int(lengths[u])
                pieces.append((name, f, d, end, end))
            elif bos and a <= lo < b:
                pieces.append((name, f, d, 0, 0))
        return pieces, bos_done

    def pending_bos_done(self) -> list[list[Any]]:
        """The documents told to get no BOS (``bos_done``) not yet met in a block."""
        return list(self._no_bos_list)  # kept equal to _no_bos, as the state lists it

    def pieces(self, s: Stream, a: int, b: int) -> list[StreamPiece]:
        """The document pieces among stream tokens ``a .. b`` (placed specials left out)."""
        if a >= b:
            return []
        return [
            (self.dataset_names[ds], f, d, start, start + length)
            for ds, f, d, start, length in s.rows_between(a, b).tolist()
            if ds >= 0 and length > 0
        ]

    def _dataset_id(self, name: str) -> int:
        i = self._ds_ids.get(name)
        if i is None:
            i = self._ds_ids[name] = len(self.dataset_names)
            self.dataset_names.append(name)
        return i

    def _expand(self, block: DocumentBlock, pre_state: Any) -> Stream:
        """Place the block's document specials: its tokens, provenance rows and units."""
        run = block.__dict__.get(RUN_OF)
        if run is not None and self._pure(run[0]):  # the whole block is checked when laid out
            return self._slice(block, pre_state, *run)
        _check_block(block)
        carry_in = sorted([list(k) for k in self._open]) if self._combined else []
        no_bos_in = self._no_bos_list
        ds_id = self._dataset_id(block.dataset)
        tokens = np.asarray(block.tokens)
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        pieces = _Pieces.of(block)
        addbos, addeos, skipped, unit_off = self._units(block, tokens, pieces)
        rows = self._provenance_rows(block, ds_id, pieces, addbos, addeos)
        row_off = row_offsets(rows)
        return Stream(
            pre_state,
            carry_in,
            self._place_specials(tokens, pieces.off, unit_off, addbos, addeos),
            rows,
            row_off,
            unit_off,
            unit_last=pieces.last,
            block=block,
            unit_bos=addbos,
            unit_eos=addeos,
            no_bos_in=no_bos_in,
            bos_skipped=frozenset(skipped),
            pin_at=self._pins(block, pieces, unit_off, skipped),
        )

    def _pure(self, block: DocumentBlock) -> bool:
        """Whether ``block``'s layout depends on the block and the specials alone (no
        open-document or no-BOS record to consult, not a block a rescale handed back)."""
        return not self._combined and not self._no_bos and block.stop is None

    def span(
        self, block: DocumentBlock, lo: int, skip: int, hi: int, cut: int
    ) -> tuple[int, int] | None:
        """Where ``cut_block(block, lo, skip, hi, cut)`` lies in the stream of the whole
        ``block``, as stream offsets ``(a, b)``: its stream is exactly tokens ``a .. b`` of
        the whole block's stream (a piece going on from token ``skip`` has no BOS, a piece cut
        after ``cut`` tokens no EOS). None when the layout is not the block's own
        (:meth:`_pure`)."""
        own = self.own_layout(block)
        if own is None:
            return None
        return own.offset(lo, skip), own.offset(hi, cut)

    def own_layout(self, block: DocumentBlock) -> OwnLayout | None:
        """The layout of the whole ``block`` (:meth:`units` ``(block, peek=True)``, and as
        Python lists), kept with the block: the mix and Pack's cursor look up offsets in it at
        every run. None when the layout is not the block's own (:meth:`_pure`): then ask
        :meth:`units`."""
        if not self._pure(block):
            return None
        memo = block.__dict__.get(_OWN_MEMO)
        if memo is None or memo[0] != self._key:
            units = self.units(block, peek=True)
            own = OwnLayout(units, units.off.tolist(), units.bos.tolist(), token_offsets(block))
            memo = block.__dict__[_OWN_MEMO] = (self._key, own)
        return memo[1]

    def _slice(
        self,
        block: DocumentBlock,
        pre_state: Any,
        whole_block: DocumentBlock,
        lo: int,
        skip: int,
        hi: int,
        cut: int,
    ) -> Stream:
        """The stream of ``block`` = ``cut_block(whole_block, lo, skip, hi, cut)``, sliced from
        the stream of ``whole_block`` (laid out once, kept with it): equal to laying ``block``
        out (:meth:`_expand`), field by field."""
        key = (self._key, self._dataset_id(block.dataset))
        memo = whole_block.__dict__.get(_WHOLE_MEMO)
        if memo is None or memo[0] != key:
            laid = self._expand(whole_block, None)
            # kept in the block's own __dict__, so without its block: a stream naming the
            # block would make a reference cycle, and every block the mix cut would wait for
            # the cyclic garbage collector (its tokens, twice, with it); slices name their run
            laid.block = None
            memo = whole_block.__dict__[_WHOLE_MEMO] = (key, laid)
        whole: Stream = memo[1]
        span = self.span(whole_block, lo, skip, hi, cut)
        assert span is not None
        a, b = span
        return SlicedStream.cut(
            whole, pre_state, a, b, block, self._no_bos_list, (lo, skip, hi, cut)
        )

    def _pins(
        self, block: DocumentBlock, p: _Pieces, unit_off: np.ndarray, skipped: set[int]
    ) -> list[int] | None:
        """:func:`_pinned_units`, or None when continuations go on mid-row
        (:meth:`continue_mid_row`)."""
        if not self.pin_continuations:
            return None
        return _pinned_units(block, p, unit_off, skipped)

    def units(self, block: DocumentBlock, *, peek: bool = False) -> Units:
        """How Pack lays ``block`` out when it is the next block pulled: its units' stream
        offsets, the BOS placed with each, and the units that must start a row. Without
        ``peek`` the cursor's open-document and no-BOS records move on as a pull's would (a
        mirror of Pack's cursor, :class:`~torchdata_ext.nodes.interleave.Interleave`, keeps
        in step so); with ``peek`` they are left as they were."""
        saved = (set(self._open), set(self._no_bos), self._no_bos_list) if peek else None
        pieces = _Pieces.of(block)
        addbos, _, skipped, unit_off = self._units(block, np.asarray(block.tokens), pieces)
        if saved is not None:
            self._open, self._no_bos, self._no_bos_list = saved
        bos = np.zeros(len(pieces.lengths), np.int64) if addbos is None else addbos.astype(np.int64)
        return Units(unit_off, bos, self._pins(block, pieces, unit_off, skipped))

    def _units(
        self, block: DocumentBlock, tokens: np.ndarray, pieces: _Pieces
    ) -> tuple[np.ndarray | None, np.ndarray | None, set[int], np.ndarray]:
        """The BOS and EOS marks of ``block``'s pieces (None: none), the pieces whose BOS was
        delivered before a rescale, and the units' stream offsets.

        Without open-document or no-BOS records to consult (no shared BOS/EOS token, no
        rescale's delivered BOS pending) the result depends on the block and the specials
        alone, so it is kept with the block (``_UNITS_MEMO``): the mix's mirror of Pack's
        cursor lays each block it emits out, and Pack's cursor then takes the same result
        instead of computing it again."""
        key = self._key
        pure = not self._combined and not self._no_bos
        if pure:
            memo = block.__dict__.get(_UNITS_MEMO)
            if memo is not None and memo[0] == key:
                return memo[1]
        addbos, addeos = self._specials_to_add(block, tokens, pieces)
        skipped: set[int] = set()
        if self._no_bos and addbos is not None:  # BOS already delivered before a rescale
            skipped = self._skip_delivered_bos(block, addbos)
        addbos, addeos = marks_any(addbos), marks_any(addeos)
        out = addbos, addeos, skipped, _unit_offsets(pieces.lengths, addbos, addeos)
        if pure:
            block.__dict__[_UNITS_MEMO] = (key, out)
        return out

    def _specials_to_add(
        self, block: DocumentBlock, tokens: np.ndarray, pieces: _Pieces
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Which pieces get a BOS and which an EOS placed (bool masks; None: that special is
        never placed): a document's first piece a BOS and its last an EOS, unless the piece
        already begins / ends with that token; empty whole documents get none."""
        p = pieces
        addbos = addeos = None
        if self._combined:
            addeos = self._combined_eos(block, tokens, p)
        else:
            if self.bos_token is not None:
                ends_bos = _first_tokens(tokens, p.off, self.dtype) == self.bos_token
                addbos = p.first & ~(ends_bos if p.all_nonempty else p.nonempty & ends_bos)
            if self.eos_token is not None:
                ends_eos = _last_tokens(tokens, p.off, self.dtype) == self.eos_token
                addeos = p.last & ~(ends_eos if p.all_nonempty else p.nonempty & ends_eos)
        if not p.all_nonempty:  # empty whole documents are dropped (they get no specials)
            keep = p.nonempty | ~(p.first & p.last)
            addbos = None if addbos is None else addbos & keep
            addeos = None if addeos is None else addeos & keep
        return addbos, addeos

    def _combined_eos(self, block: DocumentBlock, tokens: np.ndarray, p: _Pieces) -> np.ndarray:
        """Which pieces get the shared BOS/EOS token (epochraft) placed after them: a
        document's last piece, unless it ends with the token or began with it (a document
        chunked over blocks is followed in the open documents)."""
        sep = self.eos_token
        head_s = p.nonempty & (_first_tokens(tokens, p.off, self.dtype) == sep)
        tail_s = p.nonempty & (_last_tokens(tokens, p.off, self.dtype) == sep)
        first, last = p.first, p.last
        addeos = last & ~tail_s & ~(first & head_s)
        for i in np.flatnonzero(first ^ last).tolist():  # chunked documents' ends only
            key = (block.dataset, int(block.file[i]), int(block.doc[i]))
            if first[i]:
                if head_s[i]:
                    self._open.add(key)
                else:
                    self._open.discard(key)
            elif key in self._open:
                self._open.discard(key)
                addeos[i] = False
        return addeos

    def _skip_delivered_bos(self, block: DocumentBlock, addbos: np.ndarray) -> set[int]:
        """Clear ``addbos`` (in place) for the documents whose BOS was already delivered
        before a rescale, forget them, and return those pieces' indexes."""
        skipped: set[int] = set()
        for i in np.flatnonzero(addbos).tolist():
            key = (block.dataset, int(block.file[i]), int(block.doc[i]))
            if key in self._no_bos:
                self._no_bos.discard(key)
                addbos[i] = False
                skipped.add(i)
        self._no_bos_list = sorted([list(k) for k in self._no_bos])
        return skipped

    def _place_specials(
        self,
        tokens: np.ndarray,
        off: np.ndarray,
        unit_off: np.ndarray,
        addbos: np.ndarray | None,
        addeos: np.ndarray | None,
    ) -> np.ndarray:
        """The stream tokens: the block's tokens with the BOS/EOS marked in ``addbos`` /
        ``addeos`` inserted (the block's tokens themselves when there are none)."""
        if addbos is None and addeos is None:
            return tokens[: off[-1]]
        out = np.empty(int(unit_off[-1]), self.dtype)
        at_bos = None if addbos is None else unit_off[:-1][addbos]
        at_eos = None if addeos is None else unit_off[1:][addeos] - 1
        if (len(off) - 1) * _SLICE_COPY_TOKENS <= int(off[-1]):  # long pieces: a copy each
            dest = unit_off[:-1] if addbos is None else unit_off[:-1] + addbos
            for d, a, b in zip(dest.tolist(), off[:-1].tolist(), off[1:].tolist()):
                out[d : d + b - a] = tokens[a:b]
        else:
            mask = np.ones(len(out), bool)
            if at_bos is not None:
                mask[at_bos] = False
            if at_eos is not None:
                mask[at_eos] = False
            out[mask] = tokens[: off[-1]]
        if at_bos is not None:
            out[at_bos] = self.bos_token
        if at_eos is not None:
            out[at_eos] = self.eos_token
        return out

    def _provenance_rows(
        self,
        block: DocumentBlock,
        ds_id: int,
        p: _Pieces,
        addbos: np.ndarray | None,
        addeos: np.ndarray | None,
    ) -> np.ndarray:
        """Provenance rows: [BOS] [document piece] [EOS] per piece, the ones present."""
        n = len(p.lengths)
        mid = np.empty((n, PROV_COLUMNS), np.int64)
        mid[:, 0] = ds_id
        mid[:, 1] = block.file
        mid[:, 2] = block.doc
        mid[:, 3] = block.start
        mid[:, 4] = p.lengths
        if addbos is None and p.all_nonempty and addeos is None:
            return mid
        if addbos is None and p.all_nonempty and addeos is not None and addeos.all():
            rows = np.empty((2 * n, PROV_COLUMNS), np.int64)  # rows alternate piece, EOS
            rows[0::2] = mid
            rows[1::2] = self._eos_row
            rows[1::2, 2] = mid[:, 2]
            rows[1::2, 3] = literal_code(ds_id, mid[:, 1])
            return rows
        present = np.zeros((n, 3), bool)  # per piece: its BOS row, its own row, its EOS row
        if addbos is not None:
            present[:, 0] = addbos
        present[:, 1] = p.nonempty
        if addeos is not None:
            present[:, 2] = addeos
        which = np.flatnonzero(present.ravel())
        rows3 = np.empty((n, 3, PROV_COLUMNS), np.int64)
        rows3[:, 0] = self._bos_row
        rows3[:, 1] = mid
        rows3[:, 2] = self._eos_row
        rows3[:, 0::2, 2] = mid[:, None, 2]  # the specials name their document
        rows3[:, 0::2, 3] = literal_code(ds_id, mid[:, None, 1])
        return rows3.reshape(-1, PROV_COLUMNS)[which]


class OwnLayout(NamedTuple):
    """A block's layout on its own (:meth:`StreamCursor.own_layout`): its :class:`Units`, and
    their offsets and BOS marks, and the block's token offsets, as Python lists."""

    units: Units
    off: list[int]
    bos: list[int]
    tok: list[int]

    def offset(self, j: int, t: int) -> int:
        """The stream offset of a run's edge at token ``t`` of piece ``j``: the unit's start
        (its BOS, if any) when ``t`` is 0, else after the BOS and ``t`` tokens (a run going on
        from a token has no BOS, a run cut there ends before the rest)."""
        return self.off[j] + (t + self.bos[j] if t else 0)


class _Pieces(NamedTuple):
    """A block's pieces as arrays: their token offsets and which are first, last, non-empty."""

    off: np.ndarray  # token offsets of the pieces in the block (len(block) + 1)
    lengths: np.ndarray
    first: np.ndarray  # the piece starts its document (bool)
    last: np.ndarray  # the piece ends its document (bool)
    nonempty: np.ndarray
    all_nonempty: bool

    @classmethod
    def of(cls, block: DocumentBlock) -> _Pieces:
        """The pieces of ``block`` (kept with the block: the mix's mirror and Pack's cursor
        both lay out each block the mix emits)."""
        memo = block.__dict__.get(_PIECES_MEMO)
        if memo is not None:
            return memo
        off = np.asarray(block.offsets, np.int64)
        lengths = off[1:] - off[:-1]
        nonempty = lengths > 0
        out = cls(
            off,
            lengths,
            np.asarray(block.start) == 0,
            np.asarray(block.last, bool),
            nonempty,
            bool(nonempty.all()),
        )
        block.__dict__[_PIECES_MEMO] = out
        return out


def token_offsets(block: DocumentBlock) -> list[int]:
    """``block.offsets`` as a list of Python ints, kept with the block (the mix looks offsets
    up at every run: a list index or ``bisect`` costs less than NumPy's per-call overhead)."""
    memo = block.__dict__.get(_TOKEN_OFFSETS_MEMO)
    if memo is None:
        memo = block.__dict__[_TOKEN_OFFSETS_MEMO] = block.offsets.tolist()
    return memo


def _check_block(block: Any) -> None:
    """Raise ``TypeError`` unless ``block`` is a token ``DocumentBlock``, saying where Pack goes."""
    if not isinstance(block, DocumentBlock):
        raise TypeError(
            f"Pack needs DocumentBlocks from its source, got {type(block).__name__}; "
            "put Pack right after the reader, tokenize or interleave node"
        )
    if block.tokens is None:
        raise TypeError(
            f"Pack got a text block from dataset {block.dataset!r}; tokenize first (put a "
            "tokenize node between the reader and Pack)"
        )


def _first_tokens(tokens: np.ndarray, off: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Each piece's first token (an empty piece's is a neighbour's: callers mask it out)."""
    if not tokens.size:
        return np.zeros(len(off) - 1, dtype)
    return tokens[np.minimum(off[:-1], tokens.size - 1)]


def _last_tokens(tokens: np.ndarray, off: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Each piece's last token (an empty piece's is a neighbour's: callers mask it out)."""
    if not tokens.size:
        return np.zeros(len(off) - 1, dtype)
    return tokens[np.maximum(off[1:] - 1, 0)]


def _unit_offsets(
    lengths: np.ndarray, addbos: np.ndarray | None, addeos: np.ndarray | None
) -> np.ndarray:
    """The token offsets of each piece's unit: the piece plus the specials placed with it."""
    unit_len = lengths
    if addbos is not None:
        unit_len = unit_len + addbos
    if addeos is not None:
        unit_len = unit_len + addeos
    unit_off = np.empty(len(lengths) + 1, np.int64)
    unit_off[0] = 0
    unit_len.cumsum(out=unit_off[1:])
    return unit_off


def _pinned_units(
    block: DocumentBlock, p: _Pieces, unit_off: np.ndarray, skipped: set[int]
) -> list[int] | None:
    """The stream offsets of units that must start a row (None: none): in a block a rescale
    handed back, each continuation of a document, and each unit whose BOS was delivered."""
    pin_at = None
    if block.stop is not None:  # handed back by a rescale: a continuation starts a row
        start = np.asarray(block.start)
        inside = (start > 0) & p.nonempty
        inside[1:] &= ~(  # not right after its own previous piece
            (block.doc[1:] == block.doc[:-1])
            & (block.file[1:] == block.file[:-1])
            & (start[1:] == start[:-1] + p.lengths[:-1])
        )
        pin_at = unit_off[np.flatnonzero(inside)].tolist() or None
    if skipped:  # its BOS ended a row before the rescale: the document starts the next
        pin_at = sorted({*(pin_at or []), *unit_off[sorted(skipped)].tolist()})
    return pin_at
