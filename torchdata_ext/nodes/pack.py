"""The packer node: token documents in, fixed-length packed sequences out.

Documents arrive as :class:`~torchdata_ext.document.DocumentBlock` s (possibly cut into pieces
by the reader's ``max_chunksize``). Each piece becomes a *unit*: the piece's tokens plus the
document-level specials it gets (``bos_token`` before the first piece of a document,
``eos_token`` after its last). Units are laid into lines of ``seq_len`` tokens (``seq_len + 1``
with ``shift``) between the line-level specials ``bol_token`` and ``eol_token``::

    concat   |B a a a E B b b|  ->  |bol B a a a E B b eol| |bol b b E B c c c eol| ...
    pad      whole units in arrival order, then pad:  |bol B a a a E P P eol| |bol B b b b E P eol|
    best_fit a window of units placed best-fit-decreasing into bins, each bin padded

Every output sequence is one dict of NumPy arrays (see :class:`Pack`), plus a provenance table
(:mod:`torchdata_ext.provenance`) from which :meth:`Pack.rebuild` recomputes the whole dict.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext._checks import check_int
from torchdata_ext.document import DocumentBlock
from torchdata_ext.handlers.base import DocData
from torchdata_ext.provenance import LITERAL, PAD, PROV_COLUMNS, resolve

__all__ = ["Pack", "PackedSequence"]

STATE_FORMAT = 1
_MODES = ("concat", "pad", "best_fit")
_SLICE_COPY_PIECES = 64  # up to this many pieces a block's tokens are copied piece by piece


@dataclass
class _Stream:
    """One upstream block with its document specials placed.

    ``tokens`` is the block's tokens with BOS/EOS inserted, ``rows`` its provenance rows in
    stream order (``row_off`` their token offsets, ``len(rows) + 1``), and ``unit_off`` the token
    offsets of each piece's unit (``len(block) + 1``).
    """

    pre_state: Any  # the upstream state from which the next pull gives this block
    carry_in: list[list[Any]]  # open documents that began with the shared BOS/EOS token
    tokens: np.ndarray
    rows: np.ndarray
    row_off: np.ndarray
    unit_off: np.ndarray
    # where document runs start (stream token offsets), as Pack._layout would cut the stream
    # read in one piece; built on first use by Pack._runs
    run_at: list[int] | None = None
    _row_off: list[int] | None = None  # row_off as a list, for bisect

    @property
    def n_units(self) -> int:
        return len(self.unit_off) - 1

    def starts_with_literal(self, a: int) -> bool:
        """Whether stream token ``a`` is a placed special token."""
        return bool(self.rows[int(np.searchsorted(self.row_off, a, "right")) - 1, 0] < 0)

    def rows_between(self, a: int, b: int) -> np.ndarray:
        """Provenance rows of stream tokens ``a .. b`` (``a < b``)."""
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


_Part = tuple[_Stream, int, int]  # stream tokens a .. b


class PackedSequence(NamedTuple):
    """A packed sequence before its layout is spread over its tokens (see :meth:`Pack.next_packed`).

    About a quarter of the memory of the output dict, which :meth:`Pack.materialize` makes.

    Attributes:
        tokens: the packed tokens (``seq_len``, or ``seq_len + 1`` with ``shift``).
        provenance: the ``(k, 5)`` provenance table (the output dict's ``provenance``).
        cuts: where each run of the layout starts (positions count from 0 there).
        ids: the document id of each run (-1 for line specials and padding).
        pad: the padding's token range ``(lo, hi)`` (``lo == hi``: none).
    """

    tokens: np.ndarray
    provenance: np.ndarray
    cuts: list[int]
    ids: list[int]
    pad: tuple[int, int]


class Pack(BaseNode[dict[str, np.ndarray]]):
    """Pack token documents into sequences of exactly ``seq_len`` tokens.

    Args:
        source: a node yielding token :class:`~torchdata_ext.document.DocumentBlock` s (text
            blocks raise ``TypeError``: tokenize first).
        seq_len: tokens per output sequence.
        mode: ``"concat"``: concatenate units and cut every ``seq_len`` tokens; nothing is
            dropped or padded (but the last sequence, see ``flush``). ``"pad"``: whole units in
            arrival order while they fit, then padding; a unit longer than an empty sequence
            starts a new sequence and is split across sequences. ``"best_fit"``: collect
            ``window`` pieces, cut units longer than a sequence into a head (the remainder,
            holding the document start) and full-sequence chunks, place them best-fit-decreasing
            (ties broken by arrival) into bins of one sequence (Ding et al. 2024, "Fewer
            Truncations Improve Language Modeling") and pad each bin. Bins come out ordered by
            their earliest piece in arrival order, pieces inside a bin in arrival order (a head
            that is only the BOS goes last, so it cannot be read as the start of the next).
        bos_token: placed before the first piece (``start == 0``) of every document, unless the
            document already begins with it.
        eos_token: placed after the last piece (``last``) of every document, unless the
            document already ends with it. When ``bos_token == eos_token`` (one separator,
            epochraft ``ensure_bos_eos``): a document that begins or ends with it gets nothing,
            any other gets one, at its end.
        bol_token: the first token of every output sequence ("line").
        eol_token: the last token of every output sequence (after any padding).
        pad_token: the padding token id (``loss_mask`` False).
        shift: pack ``seq_len + 1`` tokens ``x`` and output ``input_ids = x[:-1]``,
            ``labels = x[1:]``. The extra token is not reused: the next sequence starts after
            it, so no token is the label of one sequence and the input of the next.
        window: pieces per best-fit window.
        dtype: the integer dtype of ``input_ids`` and ``labels``.
        flush: at the end of a finite source, emit the last partial sequence padded (concat,
            pad) or pack the last, incomplete window (best_fit); with False drop that
            sequence (concat, pad) or that whole window (best_fit).

    Output, one dict per sequence:

    * ``input_ids`` (``dtype``, ``[seq_len]``) and with ``shift`` ``labels`` (``dtype``,
      ``[seq_len]``);
    * ``document_ids`` (``int32``): 0, 1, 2 .. the index of the document inside this sequence;
      a document's BOS/EOS get its index, padding and ``bol``/``eol`` get -1;
    * ``position_ids`` (``int32``): the position inside the document's run in this sequence,
      from 0 at every document start **and at the sequence start** for the continuation of a
      document cut by the previous sequence (attention cannot see the previous sequence), and
      likewise for a remainder placed apart from its document in best_fit. ``bol`` and ``eol``
      get 0, the padding run counts 0, 1, 2 ..;
    * ``loss_mask`` (``bool``): False on padding (with ``shift``: where the input or the label is
      padding);
    * ``provenance`` (``int64`` ``[k, 5]``, :mod:`torchdata_ext.provenance`), covering the packed
      tokens (``seq_len + 1`` with ``shift``): document rows, :data:`~.provenance.LITERAL` rows
      for bos/eos/bol/eol (one token each), one :data:`~.provenance.PAD` row for the padding.
      Dataset ids index :attr:`dataset_names`. :meth:`rebuild` turns it back into the dict.

    ``next()`` is ``materialize(next_packed())``: :meth:`next_packed` gives the sequence as a
    small :class:`PackedSequence` (tokens, provenance and the document runs, a quarter of the
    dict's memory), which the shuffle buffer holds instead of the dict, and
    :meth:`materialize_into` writes it straight into batch arrays, which Collate does.

    Pieces of one document that end up next to each other, in order, form one run (one
    document id). Empty whole documents are dropped (they get no BOS/EOS). Sources should emit
    no other empty pieces (the reader never does): an empty piece counts as neither beginning
    nor ending with a special token, and in best_fit a lone EOS of an empty last piece could be
    counted with the document placed before it.

    State keys: ``format``, ``mode``, ``seq_len``, ``shift`` (checked on restore); ``source``
    (the upstream state from which the next pull gives the block being consumed; for best_fit
    the block holding the first piece of the current window); ``consumed`` (concat, pad: tokens
    of that block, specials included, already packed; best_fit: its pieces before the window);
    ``bins`` (best_fit: bins of the window already emitted); ``open_docs`` (only with
    ``bos_token == eos_token``: ``[dataset, file, doc]`` of chunked documents open at that block
    that began with the separator); ``dataset_names``. No token data. Resume guarantee:
    restoring continues with exactly the sequences the uninterrupted run would have produced.
    """

    SOURCE_KEY = "source"

    def __init__(
        self,
        source: BaseNode,
        seq_len: int,
        *,
        mode: Literal["concat", "pad", "best_fit"] = "concat",
        bos_token: int | None = None,
        eos_token: int | None = None,
        bol_token: int | None = None,
        eol_token: int | None = None,
        pad_token: int = 0,
        shift: bool = False,
        window: int = 1000,
        dtype: np.dtype | type = np.int32,
        flush: bool = True,
        dataset_names: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self._fixed_names = [str(n) for n in dataset_names]
        if not isinstance(source, BaseNode):
            raise TypeError(
                f"source must be a torchdata.nodes.BaseNode yielding DocumentBlocks (got "
                f"{type(source).__name__}); wrap it, e.g. ShardReader(...)"
            )
        check_int("seq_len", seq_len, 1)
        if mode not in _MODES:
            raise ValueError(f"{mode=} is not a packing mode; use one of {_MODES}")
        check_int("window", window, 1)
        for name, flag in (("shift", shift), ("flush", flush)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name}={flag!r} must be True or False")
        try:
            self.dtype = np.dtype(dtype)
        except TypeError as exc:
            raise TypeError(f"{dtype=} is not a NumPy dtype; use np.int32 or np.int64") from exc
        if not np.issubdtype(self.dtype, np.integer):
            raise TypeError(f"{dtype=} must be an integer dtype such as np.int32 or np.int64")
        top = int(np.iinfo(self.dtype).max)
        for name, tok in (
            ("bos_token", bos_token),
            ("eos_token", eos_token),
            ("bol_token", bol_token),
            ("eol_token", eol_token),
            ("pad_token", pad_token),
        ):
            if tok is None and name != "pad_token":
                continue
            check_int(name, tok, 0)
            if int(tok) > top:  # type: ignore[arg-type]
                raise ValueError(
                    f"{name}={tok} does not fit dtype {self.dtype} (max {top}); use a wider dtype"
                )
        self.source = source
        self.seq_len = int(seq_len)
        self.mode = mode
        self.bos_token = None if bos_token is None else int(bos_token)
        self.eos_token = None if eos_token is None else int(eos_token)
        self.bol_token = None if bol_token is None else int(bol_token)
        self.eol_token = None if eol_token is None else int(eol_token)
        self.pad_token = int(pad_token)
        self.shift = bool(shift)
        self.window = int(window)
        self.flush = bool(flush)
        self._packed_len = self.seq_len + int(self.shift)
        self._capacity = self._packed_len - (bol_token is not None) - (eol_token is not None)
        if self._capacity < 1:
            need = 1 + (bol_token is not None) + (eol_token is not None) - int(self.shift)
            raise ValueError(
                f"seq_len={seq_len} leaves no room for document tokens next to bol_token and "
                f"eol_token; raise seq_len to at least {need}"
            )
        # one separator for both ends (epochraft): only an EOS is ever added
        self._combined = self.bos_token is not None and self.bos_token == self.eos_token
        self._bos_role = None if self._combined else self.bos_token  # token id of added BOS
        self._arange = np.arange(self._packed_len, dtype=np.int32)
        self._batch_arange = self._arange  # grown to a batch's tokens on first use
        self._bos_row = np.array([LITERAL, self.bos_token or 0, 0, 0, 1], np.int64)
        self._eos_row = np.array([LITERAL, self.eos_token or 0, 0, 0, 1], np.int64)
        self.dataset_names: list[str] = []
        self._ds_ids: dict[str, int] = {}
        self._open: set[tuple[str, int, int]] = set()
        self._cur: _Stream | None = None
        self._pos = 0
        self._skip = 0
        self._exhausted = False
        self._anchor: Any = None
        self._anchor_off = 0
        self._anchor_carry: list[list[Any]] = []
        self._bins: list[list[_Part]] | None = None
        self._bins_done = 0

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._cur, self._pos, self._exhausted, self._bins = None, 0, False, None
        if initial_state is not None:
            self._check_state(initial_state)
            self.source.reset(initial_state[self.SOURCE_KEY])
            self._anchor = initial_state[self.SOURCE_KEY]
            self._anchor_off = int(initial_state["consumed"])
            self._bins_done = int(initial_state["bins"])
            self._anchor_carry = [list(k) for k in initial_state["open_docs"]]
            self.dataset_names = [str(n) for n in initial_state["dataset_names"]]
        else:
            self.source.reset()
            self._anchor = self.source.state_dict()
            self._anchor_off, self._bins_done, self._anchor_carry = 0, 0, []
            self.dataset_names = list(self._fixed_names)
        self._ds_ids = {n: i for i, n in enumerate(self.dataset_names)}
        self._open = {(str(d), int(f), int(k)) for d, f, k in self._anchor_carry}
        self._skip = self._anchor_off

    def next(self) -> dict[str, np.ndarray]:
        return self.materialize(self.next_packed())

    def next_packed(self) -> PackedSequence:
        """The next sequence as a :class:`PackedSequence` (``next()`` is
        ``materialize(next_packed())``). For buffering nodes such as the shuffle buffer, which
        hold the small form and materialize an item when it leaves. Call after :meth:`reset`.
        """
        if self.mode == "best_fit":
            return self._next_best_fit()
        parts, filled, ran_out = self._fill(self._capacity, whole_units=self.mode == "pad")
        if filled == 0 or (ran_out and not self.flush):
            raise StopIteration
        return self._emit(parts)

    def materialize(self, item: PackedSequence | dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The output dict of a :class:`PackedSequence` (a dict is returned as it is)."""
        if not isinstance(item, PackedSequence):
            return item
        x, rows, cuts, ids, (lo, hi) = item
        size = len(x)
        lens = [b - a for a, b in zip(cuts, cuts[1:])]
        lens.append(size - cuts[-1])
        pos = np.array(cuts, np.int32).repeat(lens)
        np.subtract(self._arange, pos, out=pos)
        doc = np.array(ids, np.int32).repeat(lens)
        if not self.shift:
            real = np.empty(size, bool)
            real.fill(True)
            real[lo:hi] = False
            return {
                "input_ids": x,
                "position_ids": pos,
                "document_ids": doc,
                "loss_mask": real,
                "provenance": rows,
            }
        mask = np.empty(size - 1, bool)
        mask.fill(True)
        if hi > lo:  # the input or the label is padding
            mask[max(lo - 1, 0) : hi] = False
        return {
            "input_ids": x[:-1],
            "labels": x[1:].copy(),
            "position_ids": pos[:-1],
            "document_ids": doc[:-1],
            "loss_mask": mask,
            "provenance": rows,
        }

    @property
    def output_keys(self) -> tuple[str, ...]:
        """The keys of the output dict."""
        if self.shift:
            return (
                "input_ids",
                "labels",
                "position_ids",
                "document_ids",
                "loss_mask",
                "provenance",
            )
        return ("input_ids", "position_ids", "document_ids", "loss_mask", "provenance")

    def materialize_into(self, item: PackedSequence, out: dict[str, np.ndarray], row: int) -> None:
        """Write ``materialize(item)`` into row ``row`` of the ``[B, seq_len]`` arrays in ``out``
        (see :meth:`materialize_batch_into`)."""
        self.materialize_batch_into([item], {k: v[row : row + 1] for k, v in out.items()})

    def materialize_batch_into(
        self, items: Sequence[PackedSequence], out: dict[str, np.ndarray]
    ) -> None:
        """Write ``materialize(items[i])`` into row ``i`` of each ``[len(items), seq_len]`` array
        in ``out`` (any of the keys but ``provenance``; values are cast to each array's dtype),
        without making the output dicts: what a collating node does, for the whole batch in a
        few array operations."""
        n = self.seq_len
        size = self._packed_len
        bad = [k for k in out if k not in self.output_keys or k == "provenance"]
        if bad:
            raise KeyError(f"a Pack sequence has no {bad[0]!r}; its keys: {self.output_keys}")
        if not items:
            return
        if "input_ids" in out:
            dest = out["input_ids"]
            for i, item in enumerate(items):
                dest[i] = item.tokens[:n]
        if "labels" in out:
            dest = out["labels"]
            for i, item in enumerate(items):
                dest[i] = item.tokens[1:]
        if "position_ids" in out or "document_ids" in out:
            # every item's runs laid end to end: run r covers flat tokens cuts[r] .. cuts[r + 1]
            cuts: list[int] = []
            ids: list[int] = []
            for i, item in enumerate(items):
                base = i * size
                cuts.extend([c + base for c in item.cuts])
                ids.extend(item.ids)
            total = len(items) * size
            at = np.array(cuts, np.int32)
            lens = np.empty(len(at), np.int32)
            np.subtract(at[1:], at[:-1], out=lens[:-1])
            lens[-1] = total - at[-1]
            if "position_ids" in out:
                if len(self._batch_arange) < total:
                    self._batch_arange = np.arange(total, dtype=np.int32)
                flat = at.repeat(lens)
                np.subtract(self._batch_arange[:total], flat, out=flat)
                out["position_ids"][...] = flat.reshape(len(items), size)[:, :n]
            if "document_ids" in out:
                flat = np.array(ids, np.int32).repeat(lens)
                out["document_ids"][...] = flat.reshape(len(items), size)[:, :n]
        if "loss_mask" in out:
            dest = out["loss_mask"]
            dest[...] = True
            for i, item in enumerate(items):
                lo, hi = item.pad
                if hi > lo:  # with shift: where the input or the label is padding
                    dest[i, max(lo - 1, 0) if self.shift else lo : hi] = False

    def get_state(self) -> dict[str, Any]:
        if self.mode != "best_fit" and self._cur is not None:
            src, consumed, carry = self._cur.pre_state, self._pos, self._cur.carry_in
        else:
            src, consumed, carry = self._anchor, self._anchor_off, self._anchor_carry
        return {
            "format": STATE_FORMAT,
            "mode": self.mode,
            "seq_len": self.seq_len,
            "shift": self.shift,
            self.SOURCE_KEY: src,
            "consumed": consumed,
            "bins": self._bins_done if self.mode == "best_fit" else 0,
            "open_docs": carry,
            "dataset_names": list(self.dataset_names),
        }

    # -- provenance ----------------------------------------------------------------------------
    def inflight(self) -> list[tuple[str, int, int, int, int]]:
        """Document tokens pulled from the source but not yet emitted, as
        ``(dataset, file, doc, start, stop)``; used to hand them on when rescaling. In
        ``best_fit`` mode: the pieces of the window's bins not yet emitted, then the rest of
        the block the window ended in."""
        if self.mode == "best_fit":
            return self._best_fit_inflight()
        if self._cur is None and not self._exhausted:
            self._pull()  # restored lazily: pull the current block again (skipping what was used)
        cur = self._cur
        if cur is None or self._pos >= len(cur.tokens):
            return []
        return self._pieces(cur, self._pos, len(cur.tokens))

    def _best_fit_inflight(self) -> list[tuple[str, int, int, int, int]]:
        if self._bins is None and not self._exhausted:  # restored lazily: rebuild the window
            bins = self._build_window()
            if bins:
                self._bins = bins
        out: list[tuple[str, int, int, int, int]] = []
        for parts in (self._bins or [])[self._bins_done :]:
            for s, a, b in parts:
                out.extend(self._pieces(s, a, b))
        cur = self._cur
        if cur is not None and self._pos < cur.n_units:
            out.extend(self._pieces(cur, int(cur.unit_off[self._pos]), len(cur.tokens)))
        return out

    def _pieces(self, s: _Stream, a: int, b: int) -> list[tuple[str, int, int, int, int]]:
        """The document pieces among stream tokens ``a .. b`` (placed specials left out)."""
        if a >= b:
            return []
        return [
            (self.dataset_names[ds], f, d, start, start + length)
            for ds, f, d, start, length in s.rows_between(a, b).tolist()
            if ds >= 0 and length > 0
        ]

    def fetch_document(self, dataset: str, file: int, doc: int) -> DocData:
        """Document ``doc`` of file number ``file`` of ``dataset``, whole, from the source."""
        fetch = getattr(self.source, "fetch_document", None)
        if fetch is None:
            raise TypeError(
                f"the source {type(self.source).__name__} has no fetch_document; put Pack "
                "after nodes that implement it (ShardReader, tokenize, interleave)"
            )
        return fetch(dataset, file, doc)

    def rebuild(self, provenance: np.ndarray) -> dict[str, np.ndarray]:
        """The output dict a provenance table describes, its documents read again upstream."""
        prov = np.array(provenance, dtype=np.int64).reshape(-1, PROV_COLUMNS)
        tokens = resolve(prov, self.dataset_names, self, self.dtype)
        if len(tokens) != self._packed_len:
            raise ValueError(
                f"the provenance describes {len(tokens)} tokens but this Pack packs "
                f"{self._packed_len} (seq_len={self.seq_len}, shift={self.shift}); rebuild with "
                "the Pack that emitted it"
            )
        return self._assemble(tokens, prov)

    # -- reading upstream ----------------------------------------------------------------------
    def _pull(self) -> bool:
        """Read the next block into ``_cur``; False when the source is exhausted."""
        if self._exhausted:
            return False
        pre = self.source.state_dict()
        try:
            block = next(self.source)
        except StopIteration:
            self._exhausted = True
            return False
        self._cur = self._expand(block, pre)
        self._pos, self._skip = self._skip, 0
        return True

    def _dataset_id(self, name: str) -> int:
        i = self._ds_ids.get(name)
        if i is None:
            i = self._ds_ids[name] = len(self.dataset_names)
            self.dataset_names.append(name)
        return i

    def _expand(self, block: DocumentBlock, pre_state: Any) -> _Stream:
        """Place the block's document specials: its tokens, provenance rows and units."""
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
        carry_in = sorted([list(k) for k in self._open]) if self._combined else []
        ds_id = self._dataset_id(block.dataset)
        tokens = np.asarray(block.tokens)
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        off = np.asarray(block.offsets, np.int64)
        n = len(off) - 1
        lengths = off[1:] - off[:-1]
        last = np.asarray(block.last, bool)
        nonempty = lengths > 0
        all_nonempty = bool(nonempty.all())
        first = np.asarray(block.start) == 0
        # empty whole documents are dropped (they get no specials)
        keep = None if all_nonempty else nonempty | ~(first & last)
        safe = tokens.size - 1 if tokens.size else 0
        if self._combined or self.bos_token is not None:
            head = tokens[np.minimum(off[:-1], safe)] if tokens.size else np.zeros(n, self.dtype)
        if self._combined or self.eos_token is not None:
            tail = tokens[np.maximum(off[1:] - 1, 0)] if tokens.size else np.zeros(n, self.dtype)
        addbos = addeos = None
        if self._combined:
            sep = self.eos_token
            head_s, tail_s = nonempty & (head == sep), nonempty & (tail == sep)
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
        else:
            if self.bos_token is not None:
                ends_bos = head == self.bos_token
                addbos = first & ~(ends_bos if all_nonempty else nonempty & ends_bos)
            if self.eos_token is not None:
                ends_eos = tail == self.eos_token
                addeos = last & ~(ends_eos if all_nonempty else nonempty & ends_eos)
        if keep is not None:
            addbos = None if addbos is None else addbos & keep
            addeos = None if addeos is None else addeos & keep
        n_bos = 0 if addbos is None else int(np.count_nonzero(addbos))
        n_eos = 0 if addeos is None else int(np.count_nonzero(addeos))
        if not n_bos:
            addbos = None
        if not n_eos:
            addeos = None
        unit_len = lengths
        if addbos is not None:
            unit_len = unit_len + addbos
        if addeos is not None:
            unit_len = unit_len + addeos
        unit_off = np.empty(n + 1, np.int64)
        unit_off[0] = 0
        np.cumsum(unit_len, out=unit_off[1:])
        if n_bos or n_eos:
            out = np.empty(int(unit_off[-1]), self.dtype)
            at_bos = None if addbos is None else unit_off[:-1][addbos]
            at_eos = None if addeos is None else unit_off[1:][addeos] - 1
            if n <= _SLICE_COPY_PIECES:  # a few long pieces: one slice copy each
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
        else:
            out = tokens[: off[-1]]
        # provenance rows: [BOS] [document piece] [EOS] per piece, the ones present
        mid = np.empty((n, PROV_COLUMNS), np.int64)
        mid[:, 0] = ds_id
        mid[:, 1] = block.file
        mid[:, 2] = block.doc
        mid[:, 3] = block.start
        mid[:, 4] = lengths
        if addbos is None and all_nonempty and addeos is None:
            rows = mid
        elif addbos is None and all_nonempty and n_eos == n:  # rows alternate piece, EOS
            rows = np.empty((2 * n, PROV_COLUMNS), np.int64)
            rows[0::2] = mid
            rows[1::2] = self._eos_row
        else:
            no = np.zeros(n, bool)
            which = np.flatnonzero(
                np.stack(
                    [no if addbos is None else addbos, nonempty, no if addeos is None else addeos],
                    1,
                ).ravel()
            )
            rows3 = np.empty((n, 3, PROV_COLUMNS), np.int64)
            rows3[:, 0] = self._bos_row
            rows3[:, 1] = mid
            rows3[:, 2] = self._eos_row
            rows = rows3.reshape(-1, PROV_COLUMNS)[which]
        row_off = np.empty(len(rows) + 1, np.int64)
        row_off[0] = 0
        np.cumsum(rows[:, 4], out=row_off[1:])
        return _Stream(pre_state, carry_in, out, rows, row_off, unit_off)

    # -- concat and pad ------------------------------------------------------------------------
    def _fill(self, capacity: int, whole_units: bool) -> tuple[list[_Part], int, bool]:
        """Take up to ``capacity`` stream tokens from the cursor on (whole units if asked).

        Returns the parts, their token count, and whether the source ran out meanwhile.
        """
        parts: list[_Part] = []
        filled = 0
        while filled < capacity:
            while self._cur is None or self._pos >= len(self._cur.tokens):
                if not self._pull():
                    return parts, filled, True
            s, a = self._cur, self._pos
            space = capacity - filled
            if not whole_units:
                b = min(len(s.tokens), a + space)
            else:
                j = int(np.searchsorted(s.unit_off, a + space, "right")) - 1
                b = int(s.unit_off[j])
                if b <= a:  # the next unit (or what is left of it) does not fit
                    if filled:
                        break
                    b = a + space  # longer than an empty sequence: split it
            parts.append((s, a, b))
            filled += b - a
            self._pos = b
        return parts, filled, False

    # -- best fit ------------------------------------------------------------------------------
    def _next_best_fit(self) -> PackedSequence:
        while self._bins is None:
            bins = self._build_window()
            if bins:
                self._bins = bins
            elif self._exhausted:
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
        return self._emit(parts)

    def _advance_anchor(self) -> None:
        self._bins_done = 0
        if self._cur is not None:
            self._anchor, self._anchor_off = self._cur.pre_state, self._pos
            self._anchor_carry = self._cur.carry_in

    def _build_window(self) -> list[list[_Part]]:
        """Read ``window`` pieces from the cursor on and place them into bins."""
        segments: list[tuple[_Stream, np.ndarray, np.ndarray]] = []  # units of each block
        need = self.window
        while need:
            if self._cur is None or self._pos >= self._cur.n_units:
                if not self._pull():
                    break
                continue
            s, lo = self._cur, self._pos
            hi = min(s.n_units, lo + need)
            a, b = s.unit_off[lo:hi], s.unit_off[lo + 1 : hi + 1]
            segments.append((s, a[b > a], b[b > a]))
            need -= hi - lo
            self._pos = hi
        if need and not self.flush:
            return []
        return self._best_fit(segments)

    def _best_fit(
        self, segments: list[tuple[_Stream, np.ndarray, np.ndarray]]
    ) -> list[list[_Part]]:
        """Best-fit-decreasing placement of a window's units; the bins as lists of parts."""
        if not segments:
            return []
        cap = self._capacity
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
            for t, x, n in zip(
                sid[arrival[final]].tolist(), lo[final].tolist(), size[final].tolist()
            )
        ]
        ends = np.cumsum(np.bincount(rank[placed], minlength=n_bins)).tolist()
        return [parts[e0:e1] for e0, e1 in zip([0, *ends[:-1]], ends)]

    # -- output --------------------------------------------------------------------------------
    def _emit(self, parts: list[_Part]) -> PackedSequence:
        """The sequence made of ``parts`` (then padding and the line specials).

        Materialized, equal to ``_assemble(tokens, provenance)`` (which :meth:`rebuild` uses),
        but the layout comes from the streams' document runs (:meth:`_runs`) instead of
        :meth:`_layout`: inside a part a row continues the row before it exactly as in its
        whole stream, so only a part's first row needs :meth:`_layout`'s rule, against the last
        row of the part before (the first part always starts a run). The sequence is cut into
        runs, each with the position its counting starts from and its document id (-1 for the
        line specials and the padding), which :meth:`materialize` spreads over the tokens.
        """
        size = self._packed_len
        x = np.empty(size, self.dtype)
        cuts: list[int] = []  # where each run starts; its positions count from there
        ids: list[int] = []  # its document id
        pieces: list[np.ndarray] = []
        p = 0
        if self.bol_token is not None:
            x[0] = self.bol_token
            cuts.append(0)
            ids.append(-1)
            pieces.append(np.array([[LITERAL, self.bol_token, 0, 0, 1]], np.int64))
            p = 1
        first_cut = True  # whether the next part's first row starts a run
        doc = 0
        for s, a, b in parts:
            run_at = self._runs(s)
            x[p : p + b - a] = s.tokens[a:b]
            rows = s.rows_between(a, b)
            if pieces and not first_cut:
                first_cut = not self._continues(pieces[-1][-1].tolist(), rows[0].tolist())
            if first_cut:
                cuts.append(p)
                ids.append(doc)
                doc += 1
            lo = bisect.bisect_right(run_at, a)  # runs starting inside a .. b
            hi = bisect.bisect_left(run_at, b, lo)
            if hi > lo:
                shift = p - a
                cuts.extend([r + shift for r in run_at[lo:hi]])
                ids.extend(range(doc, doc + hi - lo))
                doc += hi - lo
            pieces.append(rows)
            p += b - a
            first_cut = False
        end = size - (self.eol_token is not None)
        if end > p:
            x[p:end] = self.pad_token
            cuts.append(p)
            ids.append(-1)
            pieces.append(np.array([[PAD, self.pad_token, 0, 0, end - p]], np.int64))
        if end < size:
            x[-1] = self.eol_token
            cuts.append(end)
            ids.append(-1)
            pieces.append(np.array([[LITERAL, self.eol_token, 0, 0, 1]], np.int64))
        rows = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return PackedSequence(x, rows, cuts, ids, (p, max(end, p)))

    def _continues(self, prev: list[int], cur: list[int]) -> bool:
        """:meth:`_layout`'s rule for two content rows: whether ``cur`` continues the run of
        ``prev`` (an EOS does; a document row does after a BOS or the contiguous previous piece
        of its document; a BOS never does)."""
        bos = self._bos_role
        if bos is not None and cur[0] == LITERAL and cur[1] == bos:
            return False
        if cur[0] < 0:
            return True
        if bos is not None and prev[0] == LITERAL and prev[1] == bos:
            return True
        return prev[0] >= 0 and prev[:3] == cur[:3] and cur[3] == prev[3] + prev[4]

    def _runs(self, s: _Stream) -> list[int]:
        """Stream token offsets where the document runs of stream ``s`` start (increasing,
        from 0), with :meth:`_layout`'s rule (the stream read as one piece)."""
        if s.run_at is None:
            rows = s.rows
            ds = rows[:, 0]
            is_data = ds >= 0
            prev, cur = rows[:-1], rows[1:]
            same_doc = (
                is_data[:-1]
                & (cur[:, 0] == prev[:, 0])
                & (cur[:, 1] == prev[:, 1])
                & (cur[:, 2] == prev[:, 2])
                & (cur[:, 3] == prev[:, 3] + prev[:, 4])
            )
            starts = np.ones(len(rows), bool)
            if self._bos_role is not None:
                is_bos = (ds == LITERAL) & (rows[:, 1] == self._bos_role)
                starts[1:] = is_bos[1:] | (is_data[1:] & ~is_bos[:-1] & ~same_doc)
            else:
                starts[1:] = is_data[1:] & ~same_doc
            s.run_at = s.row_off[:-1][starts].tolist()
        return s.run_at

    def _assemble(self, x: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The output dict of packed tokens ``x`` and their provenance ``rows``."""
        pos, doc_ids, real = self._layout(rows)
        if not self.shift:
            return {
                "input_ids": x,
                "position_ids": pos,
                "document_ids": doc_ids,
                "loss_mask": real,
                "provenance": rows,
            }
        return {
            "input_ids": x[:-1],
            "labels": x[1:].copy(),
            "position_ids": pos[:-1],
            "document_ids": doc_ids[:-1],
            "loss_mask": real[:-1] & real[1:],
            "provenance": rows,
        }

    def _layout(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Position ids, document ids and the not-padding mask, from provenance rows only.

        Rows between the line specials and outside padding are document content. A content
        row starts a new document run unless it continues the previous content row: an EOS
        always continues, a document row continues a BOS or the contiguous previous piece of
        the same document. The first content row always starts a run.
        """
        ds, lens = rows[:, 0], rows[:, 4]
        content = ds != PAD
        if self.bol_token is not None:
            content[0] = False
        if self.eol_token is not None:
            content[-1] = False
        is_data = ds >= 0
        if self._bos_role is not None:
            is_bos = content & (ds == LITERAL) & (rows[:, 1] == self._bos_role)
        else:
            is_bos = np.zeros(len(rows), bool)
        prev, cur = rows[:-1], rows[1:]
        same_doc = (
            is_data[:-1]
            & (cur[:, :3] == prev[:, :3]).all(axis=1)
            & (cur[:, 3] == prev[:, 3] + prev[:, 4])
        )
        continues = content[:-1] & ~is_bos[1:] & (~is_data[1:] | is_bos[:-1] | same_doc)
        starts = content.copy()
        starts[1:] &= ~continues
        row_off = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lens, out=row_off[1:])
        base = np.where(starts | ~content, row_off[:-1], 0).astype(np.int32)
        np.maximum.accumulate(base, out=base)
        doc_row = np.where(content, starts.cumsum(dtype=np.int32) - 1, -1).astype(np.int32)
        pos = self._arange - base.repeat(lens)
        return pos, doc_row.repeat(lens), (ds != PAD).repeat(lens)

    # -- state checks --------------------------------------------------------------------------
    def _check_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not a Pack state of format {STATE_FORMAT} (got "
                f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r})"
            )
        for key, mine in (("mode", self.mode), ("seq_len", self.seq_len), ("shift", self.shift)):
            if state[key] != mine:
                raise ValueError(
                    f"cannot restore Pack: the checkpoint has {key}={state[key]!r} but this Pack "
                    f"has {key}={mine!r}; restore with the packing settings of the checkpoint"
                )


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
