"""The packer node: token documents in, fixed-length packed sequences out.

Documents arrive as :class:`~torchdata_ext.document.DocumentBlock` s (possibly cut into pieces
by the reader's ``max_chunksize``). Each piece becomes a *unit*: the piece's tokens plus the
document-level specials it gets (``bos_token`` before the first piece of a document,
``eos_token`` after its last). Units are laid into lines of ``seq_len`` tokens (``seq_len + 1``
with ``shift``) between the line-level specials ``bol_token`` and ``eol_token``::

    concat   |B a a a E B b b|  ->  |bol B a a a E B b eol| |bol b b E B c c c eol| ...
    pad      whole units in arrival order, then pad:  |bol B a a a E P P eol| |bol B b b b E P eol|
    best_fit a window of units placed best-fit-decreasing into bins, each bin padded
    chunk    each document cut alone:  |bol B a a a eol| |bol E P P P eol| |bol B b b E eol|

Every output sequence is one dict of NumPy arrays (see :class:`Pack`), plus a provenance table
(:mod:`torchdata_ext.provenance`) from which :meth:`Pack.rebuild` recomputes the whole dict.

This module holds the node: its settings, state and provenance API. The work is split by
side and by mode, each module readable alone::

    stream.py       upstream blocks -> streams (specials placed), the read cursor
    concat_pad.py   concat / pad: fill sequences from the stream in order
    best_fit.py     best_fit: a window of units placed into bins
    chunk.py        chunk: each document cut into sequences of its own
    packed.py       parts of streams -> PackedSequence -> output dict (or batch arrays)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.checks import check_int
from torchdata_ext.handlers.base import DocData
from torchdata_ext.nodes.best_fit import BestFit
from torchdata_ext.nodes.chunk import Chunk
from torchdata_ext.nodes.concat_pad import ConcatPad
from torchdata_ext.nodes.drops import DEFAULT_MAX_DROPPED, DropWatch, readers_pass
from torchdata_ext.nodes.packed import Layout, PackedSequence
from torchdata_ext.nodes.stream import StreamCursor
from torchdata_ext.nodes.stream_types import ReplayMark, Specials, StreamPiece
from torchdata_ext.provenance import PROV_COLUMNS, resolve
from torchdata_ext.state.settings import SETTINGS_KEY, check_settings

__all__ = ["Pack", "PackedSequence"]

STATE_FORMAT = 1
_MODES = ("concat", "pad", "best_fit", "chunk")


class _Strategy(Protocol):
    """What Pack asks of a packing strategy (:mod:`.concat_pad`, :mod:`.best_fit`,
    :mod:`.chunk`)."""

    def reset(self, bins_done: int) -> None:
        """Start again at the cursor, ``bins_done`` sequences of the window already emitted."""

    def position(self) -> tuple[ReplayMark, int]:
        """The clean point to replay from, and the sequences emitted since it."""
        ...

    def next_packed(self) -> PackedSequence:
        """The next sequence; ``StopIteration`` at the end of the source."""
        ...

    def inflight(self) -> tuple[list[StreamPiece], list[list[Any]]]:
        """The document pieces pulled but not yet emitted, and the documents among them
        whose BOS was delivered (see :meth:`~.stream.StreamCursor.held`)."""
        ...


_ARGS = {"best_fit_window": "window", "pack_mode": "mode", "seq_length": "seq_len"}
"""The node arguments of the settings Pack records (by config field)."""


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
            ``"chunk"`` (epochraft's ``chunk``): each document (with its BOS/EOS) cut into
            sequences of its own, never two documents in one sequence; its last, partial
            sequence padded, or dropped with ``drop_remainder``. In ``"concat"`` mode a
            source with a ``follow_rows(cursor, capacity)`` method (``Interleave``) is
            given a mirror of this Pack's cursor and the row capacity, so it knows where rows
            end in its own output (it may switch datasets inside a document there).
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
            sequence (concat, pad, chunk) or that whole window (best_fit).
        drop_remainder: ``chunk`` mode only: drop each document's last sequence when it is
            not full (its tokens are never delivered) instead of padding it.
        dataset_names: the datasets' provenance ids, in order (``build_pipeline``: the config's
            ``datasets``); a dataset not listed gets the next id when first met. A restore keeps
            these ids whatever order the checkpoint's state lists the names in.
        max_dropped: with ``drop_remainder`` on an endless source: fail
            (:class:`~torchdata_ext.nodes.drops.NothingKeptError`) after this many documents in a
            row gave no sequence (all shorter than one), or after a whole pass over the readers'
            documents, instead of pulling forever (default one million; None: only the pass).

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
    the block holding the first piece of the current window); ``consumed`` (concat, pad, chunk: tokens
    of that block, specials included, already packed; best_fit: its pieces before the window);
    ``bins`` (best_fit: bins of the window already emitted); ``open_docs`` (only with
    ``bos_token == eos_token``: ``[dataset, file, doc]`` of chunked documents open at that block
    that began with the separator); ``bos_done`` (``[dataset, file, doc]`` of documents a
    rescale handed back whose BOS was already delivered: they get none again; empty but right
    after such a rescale); ``dataset_names``. No token data. Resume guarantee:
    restoring continues with exactly the sequences the uninterrupted run would have produced.
    """

    SOURCE_KEY = "source"

    def __init__(
        self,
        source: BaseNode,
        seq_len: int,
        *,
        mode: Literal["concat", "pad", "best_fit", "chunk"] = "concat",
        bos_token: int | None = None,
        eos_token: int | None = None,
        bol_token: int | None = None,
        eol_token: int | None = None,
        pad_token: int = 0,
        shift: bool = False,
        window: int = 1000,
        dtype: np.dtype | type = np.int32,
        flush: bool = True,
        drop_remainder: bool = False,
        dataset_names: Sequence[str] = (),
        max_dropped: int | None = DEFAULT_MAX_DROPPED,
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
        for name, flag in (("shift", shift), ("flush", flush), ("drop_remainder", drop_remainder)):
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
        if drop_remainder and mode != "chunk":
            raise ValueError(f"drop_remainder=True is for mode='chunk' only (got {mode=})")
        self.drop_remainder = bool(drop_remainder)
        # what the saved position means (see state/settings.py); never mutated
        self._settings: dict[str, Any] = {
            "pack_mode": mode,  # (also the state's "mode", "seq_len", "shift", read before
            "seq_length": self.seq_len,  # these were recorded; here for the restore's
            "shift": self.shift,  # check by config field, checkpoint/restore.py)
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "bol_token": self.bol_token,
            "eol_token": self.eol_token,
        }
        if mode == "best_fit":
            self._settings["best_fit_window"] = self.window
        if mode == "chunk":
            self._settings["drop_remainder"] = self.drop_remainder
        specials = Specials(
            self.bos_token, self.eos_token, self.bol_token, self.eol_token, self.pad_token
        )
        self._layout = Layout(self.seq_len, self.shift, self.dtype, specials)
        if self._layout.capacity < 1:
            need = 1 + (bol_token is not None) + (eol_token is not None) - int(self.shift)
            raise ValueError(
                f"seq_len={seq_len} leaves no room for document tokens next to bol_token and "
                f"eol_token; raise seq_len to at least {need}"
            )
        self._cursor = StreamCursor(source, self.dtype, specials)
        self._strategy: _Strategy
        if mode == "best_fit":
            self._strategy = BestFit(
                self._cursor, self._layout, window=self.window, flush=self.flush
            )
        elif mode == "chunk":
            drops = DropWatch(
                f"Pack(mode='chunk', drop_remainder=True, seq_len={self.seq_len})",
                max_dropped,
                "the documents are shorter than a sequence: lower seq_len or set "
                "drop_remainder=False (pad them), or raise max_dropped_documents",
            )
            self._strategy = Chunk(
                self._cursor,
                self._layout,
                drop_remainder=self.drop_remainder,
                flush=self.flush,
                drops=drops,
            )
        else:
            self._strategy = ConcatPad(
                self._cursor, self._layout, whole_units=mode == "pad", flush=self.flush
            )
        self._mirror = self._rows_to(source, specials)

    def _rows_to(self, source: BaseNode, specials: Specials) -> StreamCursor | None:
        """In ``concat`` mode, give a source that takes it (``follow_rows``) a mirror of this
        Pack's cursor and the row capacity, so the mix may switch sources at row ends."""
        follow = getattr(source, "follow_rows", None)
        if self.mode != "concat" or not callable(follow):
            return None
        mirror = StreamCursor(None, self.dtype, specials)  # it never reads
        if specials.eos is not None and not specials.combined:
            # every document ends with its own EOS: a continuation fills the row (see
            # StreamCursor.continue_mid_row), in Pack's cursor and in its mirror alike
            self._cursor.continue_mid_row()
            mirror.continue_mid_row()
        follow(mirror, self._layout.capacity)
        return mirror

    @property
    def dataset_names(self) -> list[str]:
        """The dataset names indexed by the dataset ids of the provenance tables: the
        ``dataset_names`` given, in that order (also after a restore from a state that lists
        them in another order), then any other dataset met, in the order met."""
        return self._cursor.dataset_names

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self._check_state(initial_state)
            self.source.reset(initial_state[self.SOURCE_KEY])
            consumed, bins_done = int(initial_state["consumed"]), int(initial_state["bins"])
            carry = [list(k) for k in initial_state["open_docs"]]
            done = [list(k) for k in initial_state.get("bos_done", [])]  # absent before 0.2
            start = ReplayMark(initial_state[self.SOURCE_KEY], consumed, carry, done)
            saved = [str(n) for n in initial_state["dataset_names"]]
            # provenance ids follow this Pack's dataset_names, whatever order the checkpoint
            # met them in (a config may list its datasets in another order on restore); a node
            # holding ids of the saved state maps them with provenance.remap_ids
            names = self._fixed_names + [n for n in saved if n not in self._fixed_names]
        else:
            self.source.reset()
            start, bins_done = ReplayMark(self.source.state_dict(), 0, []), 0
            names = list(self._fixed_names)
        self._cursor.reset(start, names)
        if self._mirror is not None:  # the source's mirror of the cursor, at the same block
            self._mirror.reset(start, names)
        self._strategy.reset(bins_done)
        if isinstance(self._strategy, Chunk):
            endless, cycle = readers_pass(self.source)
            self._strategy.drops.reset(endless=endless, cycle=cycle)

    def next(self) -> dict[str, np.ndarray]:
        return self._layout.materialize(self._strategy.next_packed())

    def next_packed(self) -> PackedSequence:
        """The next sequence as a :class:`PackedSequence` (``next()`` is
        ``materialize(next_packed())``). For buffering nodes such as the shuffle buffer, which
        hold the small form and materialize an item when it leaves. Call after :meth:`reset`.
        """
        return self._strategy.next_packed()

    def materialize(self, item: PackedSequence | dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The output dict of a :class:`PackedSequence` (a dict is returned as it is)."""
        if not isinstance(item, PackedSequence):
            return item
        return self._layout.materialize(item)

    @property
    def output_keys(self) -> tuple[str, ...]:
        """The keys of the output dict."""
        return self._layout.output_keys

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
        self._layout.materialize_batch_into(items, out)

    def get_state(self) -> dict[str, Any]:
        start, bins_done = self._strategy.position()
        return {
            "format": STATE_FORMAT,
            "mode": self.mode,
            "seq_len": self.seq_len,
            "shift": self.shift,
            self.SOURCE_KEY: start.source,
            "consumed": start.consumed,
            "bins": bins_done,
            "open_docs": start.open_docs,
            "bos_done": start.bos_done,
            "dataset_names": list(self.dataset_names),
            SETTINGS_KEY: self._settings,
        }

    # -- provenance ----------------------------------------------------------------------------
    def inflight(self) -> list[tuple[str, int, int, int, int]]:
        """Document tokens pulled from the source but not yet emitted, as
        ``(dataset, file, doc, start, stop)``; used to hand them on when rescaling. In
        ``best_fit`` mode: the pieces of the window's bins not yet emitted, then the rest of
        the block the window ended in. See :meth:`held` for the specials."""
        return self.held()[0]

    def held(self) -> tuple[list[tuple[str, int, int, int, int]], list[list[Any]]]:
        """:meth:`inflight`, and ``[dataset, file, doc]`` of the documents among the pieces
        whose BOS was already delivered (a row ended with it): a rescale tells the pieces'
        new owner not to place it again (the ``bos_done`` state key; documents it names that
        this Pack has not met yet are reported again). A document of which only the EOS is
        held is handed back as its empty last piece ``(end, end)``."""
        pieces, done = self._strategy.inflight()
        return pieces, done + self._cursor.pending_bos_done()

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
        return self._layout.materialize(self.rebuild_packed(provenance))

    def rebuild_packed(self, provenance: np.ndarray) -> PackedSequence:
        """The :class:`PackedSequence` a provenance table describes (what :meth:`next_packed`
        gave), its documents read again upstream: :meth:`rebuild` before materializing."""
        prov = np.array(provenance, dtype=np.int64).reshape(-1, PROV_COLUMNS)
        tokens = resolve(prov, self.dataset_names, self, self.dtype)
        if len(tokens) != self._layout.packed_len:
            raise ValueError(
                f"the provenance describes {len(tokens)} tokens but this Pack packs "
                f"{self._layout.packed_len} (seq_len={self.seq_len}, shift={self.shift}); "
                "rebuild with the Pack that emitted it"
            )
        return self._layout.packed(tokens, prov)

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
        check_settings("Pack", state, self._settings, _ARGS)
