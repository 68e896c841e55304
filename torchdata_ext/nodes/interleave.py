"""The interleave node: mix several sources of document blocks at chosen weights.

Two rules pick the source of each next document. A document the reader cut into pieces
(``max_chunksize``; a piece with ``last`` False has more to come) is finished before the next
decision, as fms-fsdp's sampler does: after such a piece the same source goes on until the
piece that ends the document, even across the source's blocks. So downstream every document's
pieces are contiguous and in order, and the packer places its BOS/EOS at the document's real
ends only (``Pack`` in ``concat`` and ``pad`` mode keeps them so in its sequences; ``best_fit``
places the pieces of a window by size, by design). The decision rules:

**Row cuts** (``"tokens"`` mode feeding a ``concat`` Pack directly, which calls
:meth:`Interleave.follow_rows`): the node mirrors Pack's cursor, so it knows where rows end in
its own output (``row_fill``), and a run may end inside a document exactly at a row end
(:mod:`.row_cuts`; a zero-copy token slice); the rest goes on later at a row start, with no
BOS, as any document spanning rows. While another source holds a document open, runs end only
at row ends (a source mid-row goes on), so a document always goes on at a row start; only when
a finite source ends mid-row does one go on mid-row, after the EOS of the document before it
(without an EOS, or with BOS and EOS one token, it is marked handed back instead, ``stop``:
Pack pads that row and starts it on the next, as it does a rescale's rests then; see
:meth:`~torchdata_ext.nodes.stream.StreamCursor.continue_mid_row`). ``pad``, ``best_fit``,
``chunk``, ``"samples"`` and a mix under a budget or in phases keep documents whole (pieces
never split).

* ``"tokens"`` (deterministic, as in Bamba): the source furthest below its target share of
  tokens, i.e. the active source with the lowest ``tokens_delivered[s] / weight[s]``; ties go to
  the source listed first. Instead of deciding document by document in Python, the node takes in
  one step the longest run of the chosen source's current block for which the rule would have
  kept choosing it (a ``searchsorted`` on the block's cumulative lengths against the
  second-lowest ratio, then on to the next piece that ends a document, or to a row end), which
  gives exactly the same sequence. The tokens of a whole document count, so a share stays within
  ``(quantum_tokens + longest document) / tokens delivered`` of its target; with row cuts within
  about ``(quantum_tokens + 2 rows) / tokens delivered``.
* ``"samples"`` (random): draw ``k`` picks source ``s`` with probability ``weight[s] / sum of
  the active weights``, once per document (the rest of a cut document takes no draw). Draw
  ``k`` is a pure function of ``(seed, k)``: uniform ``u_k`` is the SplitMix64 finalizer of
  ``key + (k + 1) * 0x9E3779B97F4A7C15`` (``key = mix_seed(seed, tag)``) scaled to ``[0, 1)``,
  computed for many ``k`` at once with NumPy, so the state holds only the counter ``k``. Runs
  of consecutive draws of the same source come out as one block. Weights count documents here,
  not tokens.

Each output block is a zero-copy :meth:`~torchdata_ext.document.DocumentBlock.select` of one
source's block, so it holds one dataset and keeps the source's ``shard`` and ``epoch``. Endless
sources (readers with ``epochs=None``) go through their own epochs; a finite source that raises
``StopIteration`` is dropped and the mix goes on with the rest, until all have ended.

This module is 731 lines: the two decision rules, their one-step runs, the row cuts' bookkeeping
(the pure part is :mod:`torchdata_ext.nodes.row_cuts`) and the replayed state are one node.

State (replay, no token copies)::

    {"sources": {name: {"source": <its state before its current block>,
                        "consumed": <pieces of that block already emitted>,
                        "offset": <tokens of the next piece already emitted (a row cut)>,
                        "ended": bool}},
     "tokens_delivered": {name: int},
     "row_fill": <tokens of Pack's current row after the output; None: no row cuts>,
     "finishing": <the source that must go on next, or None>,
     "cuts_handed_back": True,  # absent: saved when handed-back rests were delivered whole
     "counter": int}

On restore each source is reset to its saved state, its current block is read again and the
``consumed`` pieces are skipped. A source whose last emitted piece leaves a document open keeps
its block in the state even when all of it was emitted (``consumed`` equals the block's length),
so the restored node knows from the block's ``last`` flags that the document is open. A
state without ``row_fill`` (saved before row cuts) goes on document by document, exactly as it
would have. Resume guarantee: restoring a state continues with exactly the blocks the
uninterrupted run would have produced next. ``tokens_delivered`` is plain ``name -> int`` so it
can be summed and re-split across ranks.

Rescaling: :meth:`inflight` reports the pieces held, and first reads each source on to the end of
a document it left open (those pieces are reported too), so the readers' cursors at the cut lie
between documents and the handed-back pieces hold the whole rest of every open document. The new
owner's reader delivers them first; its mix cuts them at row ends like any document (a
handed-back rest starts a row, and rows are counted from there), so the shares follow the
weights right after a rescale. A state saved when such rests were delivered whole (no
``cuts_handed_back`` key) decides the block the nodes above replay so, then cuts.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.document import DocumentBlock
from torchdata_ext.handlers.base import DocData
from torchdata_ext.nodes.row_cuts import RunBlock, cut_block, fill_after, first_row_end
from torchdata_ext.nodes.stream import token_offsets
from torchdata_ext.nodes.stream_types import LazyState
from torchdata_ext.order.walk import mix_seed
from torchdata_ext.state.settings import SETTINGS_KEY, check_settings

if TYPE_CHECKING:
    from torchdata_ext.nodes.stream import StreamCursor

__all__ = ["Interleave"]

_SAMPLES_TAG = 0x494E544C  # keeps the draw key apart from other uses of the seed
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


def _counter_uniforms(key: int, start: int, count: int) -> np.ndarray:
    """Uniforms in ``[0, 1)`` for draws ``start .. start + count``: a pure function of
    ``(key, draw number)`` (SplitMix64 at position ``draw + 1`` of the stream seeded by ``key``)."""
    x = (np.arange(start + 1, start + count + 1, dtype=np.uint64) * _GAMMA) + np.uint64(key)
    x = (x ^ (x >> np.uint64(30))) * _MUL1
    x = (x ^ (x >> np.uint64(27))) * _MUL2
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


_ARGS = {"interleave_mode": "mode", "mix_quantum_tokens": "quantum_tokens"}
"""The node arguments of the settings Interleave records (by config field)."""


def _ratio_bisect(
    off: list[int], lo: int, hi: int, t: int, w: float, r2: float, right: bool
) -> int:
    """``bisect_right`` (``right``) or ``bisect_left`` of ``r2`` in ``off[lo:hi]`` by the key
    ``(o + t) / w``, exactly, without a Python key call per probe: a plain bisect for the
    threshold ``r2 * w - t``, then a step or two to where the key itself crosses ``r2``."""
    i = bisect.bisect_right(off, r2 * w - t, lo, hi)
    if right:
        while i > lo and (off[i - 1] + t) / w > r2:
            i -= 1
        while i < hi and (off[i] + t) / w <= r2:
            i += 1
    else:
        while i > lo and (off[i - 1] + t) / w >= r2:
            i -= 1
        while i < hi and (off[i] + t) / w < r2:
            i += 1
    return i


class Interleave(BaseNode[DocumentBlock]):
    """Mix sources of :class:`~torchdata_ext.document.DocumentBlock` s at chosen weights.

    Args:
        sources: name -> node; the order breaks ties in ``"tokens"`` mode and maps the
            ``"samples"`` draws. Names key the state; a restored state keeps the order it was
            saved in (the same sources listed in another order go on exactly as saved).
        weights: name -> weight (> 0, need not sum to 1), one per source.
        mode: ``"tokens"``: each source gets ``weight / sum(weights)`` of the tokens
            (deterministic); ``"samples"``: each document is drawn from a source with probability
            proportional to its weight (seeded).
        seed: the seed of the ``"samples"`` draws.
        quantum_tokens: ``"tokens"`` mode only: keep taking from the chosen source until it is
            this many tokens past the next source's share (0, the default here: decide
            document by document, as Bamba; the pipeline's default is one sequence,
            ``PipelineConfig.mix_quantum_tokens``). A run also ends at the end of the source's
            current block (``block_docs`` documents), or of a document open there, where the
            rule decides again. A few thousand tokens cuts the per-decision overhead when
            documents are short; any share stays within ``(quantum_tokens + longest document)
            / tokens delivered`` of its target, or with row cuts (module docstring) ~2 rows.

    Raises:
        ValueError: no sources, a weight <= 0 (or not finite), a missing or extra weight, or an
            unknown mode.
    """

    SOURCES_KEY = "sources"
    SOURCE_KEY = "source"
    CONSUMED_KEY = "consumed"
    OFFSET_KEY = "offset"
    FILL_KEY = "row_fill"
    FINISHING_KEY = "finishing"
    CUTS_BACK_KEY = "cuts_handed_back"
    ENDED_KEY = "ended"
    TOKENS_KEY = "tokens_delivered"
    COUNTER_KEY = "counter"

    def __init__(
        self,
        sources: Mapping[str, BaseNode[DocumentBlock]],
        weights: Mapping[str, float],
        *,
        mode: Literal["tokens", "samples"] = "tokens",
        seed: int = 0,
        quantum_tokens: int = 0,
    ) -> None:
        super().__init__()
        if (
            isinstance(quantum_tokens, bool)
            or not isinstance(quantum_tokens, (int, np.integer))
            or quantum_tokens < 0
        ):
            raise ValueError(f"{quantum_tokens=} must be an integer >= 0")
        self.quantum_tokens = int(quantum_tokens)
        if not isinstance(sources, Mapping) or not isinstance(weights, Mapping):
            raise TypeError("sources and weights must be mappings name -> node and name -> weight")
        if not sources:
            raise ValueError("sources is empty; pass at least one name -> node")
        for name, node in sources.items():
            if not isinstance(name, str):
                raise TypeError(f"source name {name!r} must be a str")
            if not isinstance(node, BaseNode):
                raise TypeError(f"sources[{name!r}] must be a torchdata.nodes.BaseNode")
        missing = [n for n in sources if n not in weights]
        extra = [n for n in weights if n not in sources]
        if missing:
            raise ValueError(f"weights has no entry for source(s) {missing}; give every source one")
        if extra:
            raise ValueError(
                f"weights names {extra}, which are not sources (sources: {list(sources)})"
            )
        for name in sources:
            w = weights[name]
            if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)):
                raise TypeError(f"weights[{name!r}]={w!r} must be a positive number")
            if not (math.isfinite(w) and w > 0):
                raise ValueError(f"weights[{name!r}]={w!r} must be a finite number > 0")
        if mode not in ("tokens", "samples"):
            raise ValueError(f"{mode=} must be 'tokens' or 'samples'")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"{seed=} must be an int")
        self.names: list[str] = list(sources)
        self.sources: list[BaseNode[DocumentBlock]] = [sources[n] for n in self.names]
        self.weights: list[float] = [float(weights[n]) for n in self.names]
        self._target_weights = list(self.weights)
        self._configured = (list(self.names), dict(sources), dict(zip(self.names, self.weights)))
        self._switch_weights = False
        self.mode = mode
        self.seed = int(seed)
        # what the saved counters mean (see state/settings.py); never mutated
        self._settings = {"interleave_mode": mode, "mix_quantum_tokens": self.quantum_tokens}
        self._key = mix_seed(self.seed, _SAMPLES_TAG)
        n = len(self.names)
        self._blocks: list[DocumentBlock | None] = [None] * n
        self._before: list[Any] = [None] * n  # source state before its current block
        self._consumed = [0] * n
        self._offset = [0] * n  # tokens of piece ``consumed`` already emitted (a row cut)
        self._whole = [True] * n  # whether every piece of the current block ends its document
        self._ended = [False] * n
        self._tokens = [0] * n
        self._counter = 0
        self._open: int | None = None  # the source whose last emitted piece left a document open
        # blocks inflight() read ahead to the end of an open document: (state before, block)
        self._ahead: list[list[tuple[Any, DocumentBlock]]] = [[] for _ in range(n)]
        self._owner: dict[str, int] = {}  # dataset name -> source index, learned from blocks
        self._mirror: StreamCursor | None = None  # Pack's cursor, mirrored (see follow_rows)
        self._capacity = 0  # document tokens per row
        self._fill: int | None = None  # tokens of the current row after our output; None: off
        self._whole_hand_back = False  # decide handed-back pieces whole (a state from before)
        # get_state's last entry per source and weights dict, given again while unchanged
        self._last_entries: list[dict[str, Any] | None] = [None] * n
        self._last_weights: tuple[list[float] | None, dict[str, float]] = (None, {})

    def follow_rows(self, mirror: StreamCursor, capacity: int) -> None:
        """Let ``"tokens"`` mode switch sources inside a document where a row ends (Pack in
        ``concat`` mode calls this with a mirror of its cursor, reset with it, and its
        document tokens per row ``capacity``). Ignored in ``"samples"`` mode."""
        if self.mode == "tokens":
            self._mirror, self._capacity = mirror, int(capacity)

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            check_settings("Interleave", initial_state, self._settings, _ARGS)
        self._order(None if initial_state is None else list(initial_state[self.SOURCES_KEY]))
        n = len(self.names)
        self._blocks = [None] * n
        self._before = [None] * n
        self._consumed = [0] * n
        self._offset = [0] * n
        self._ended = [False] * n
        self._open = None
        self._fill = None if self._mirror is None else 0
        self._whole_hand_back = False
        self._ahead = [[] for _ in range(n)]
        self.weights = list(self._target_weights)
        self._switch_weights = False
        if initial_state is not None and "weights" in initial_state:
            saved = [
                float(initial_state["weights"].get(name, w))
                for name, w in zip(self.names, self.weights)
            ]
            if saved != self.weights:
                # the first block after a restore is replayed by the nodes above (they skip what
                # they already used), so it must come out as it did: decide it with the weights
                # in force when the state was saved, then move to the new targets
                self.weights = saved
                self._switch_weights = True
        if initial_state is None:
            for src in self.sources:
                src.reset()
            self._tokens = [0] * n
            self._counter = 0
            return
        per_source = initial_state[self.SOURCES_KEY]
        tokens = initial_state[self.TOKENS_KEY]
        if set(per_source) != set(self.names) or set(tokens) != set(self.names):
            raise ValueError(
                f"the interleave state has sources {sorted(per_source)} but this node has "
                f"{sorted(self.names)}; restore with the same source names"
            )
        self._tokens = [int(tokens[name]) for name in self.names]
        self._counter = int(initial_state[self.COUNTER_KEY])
        fill = initial_state.get(self.FILL_KEY)  # absent before row cuts: they stay off
        self._fill = None if fill is None or self._mirror is None else int(fill)
        # saved when handed-back pieces were delivered whole: the block the nodes above
        # replay (the first) must come out as it did, so it is decided so; then cuts go on
        self._whole_hand_back = not initial_state.get(self.CUTS_BACK_KEY, False)
        finishing = initial_state.get(self.FINISHING_KEY, "")  # "" : not recorded
        replay: list[tuple[int, str, Any, int]] = []  # sources whose block is read again
        for i, name in enumerate(self.names):
            st = per_source[name]
            self.sources[i].reset(st[self.SOURCE_KEY])
            self._ended[i] = bool(st[self.ENDED_KEY])
            consumed = int(st[self.CONSUMED_KEY])
            self._offset[i] = int(st.get(self.OFFSET_KEY, 0))
            if (consumed == 0 and not self._offset[i]) or self._ended[i]:
                continue
            # a tokenizing source need not encode what was delivered before, and starts on
            # the rest now: every source's block is encoded side by side (see Tokenize)
            hint = getattr(self.sources[i], "skip_next", None)
            if callable(hint):
                hint(consumed)
            replay.append((i, name, st, consumed))
        for i, name, st, consumed in replay:
            try:
                block = next(self.sources[i])
            except StopIteration:
                block = None
            if block is None or len(block) < consumed + (self._offset[i] > 0):
                raise ValueError(
                    f"source {name!r}: the block read again on restore has "
                    f"{0 if block is None else len(block)} pieces but the state says {consumed} "
                    "were already delivered; the data or the source's configuration changed "
                    "since the checkpoint was taken"
                )
            self._blocks[i] = block
            self._before[i] = st[self.SOURCE_KEY]
            self._consumed[i] = consumed
            self._whole[i] = bool(block.last.all())
            self._owner.setdefault(block.dataset, i)
            if finishing == "" and not block.last[consumed - 1]:  # a state from before 0.3
                self._open = i
        if finishing:
            self._open = self.names.index(finishing)

    def next(self) -> DocumentBlock:
        while True:
            active = [i for i, ended in enumerate(self._ended) if not ended]
            if not active:
                raise StopIteration
            if self._switch_weights:  # a source added since the checkpoint waits its turn
                weighted = [i for i in active if self.weights[i] > 0]
                if weighted:
                    active = weighted
                else:  # only the added sources are left: the new targets apply now
                    self._take_targets()
            s = self._open  # a document in progress is finished first
            drawn = s is None
            if s is None:
                s = self._pick(active)
            resuming = drawn and self._holds_open(s)  # a document left open at a row end
            if not self._ensure_block(s):
                self._open = None
                continue  # s ended: decide again among the others
            block = self._blocks[s]
            assert block is not None
            lo = self._consumed[s]
            if self.mode == "tokens":
                hi, cut = self._tokens_run(s, active, block, lo)
            else:
                count, draws = self._samples_run(s, active, block, lo, drawn)
                self._counter += draws
                hi, cut = lo + count, 0
            out = self._emit(s, block, lo, hi, cut, resuming)
            if self._switch_weights:
                self._take_targets()
            return out

    def _take_targets(self) -> None:
        """Switch from the weights saved in the state to the configured ones (after the block
        the restore replays), and count the tokens delivered so far as if they had been mixed
        at the new weights (same total): the new mix holds from here on, without first making
        up for the old one (weights 1:1 -> 1:3 after 1B tokens would otherwise feed only the
        second source for the next 2B tokens)."""
        self.weights, self._switch_weights = list(self._target_weights), False
        total, w = sum(self._tokens), sum(self.weights)
        shares = [int(total * x // w) for x in self.weights]
        shares[0] += total - sum(shares)
        self._tokens = shares

    def get_state(self) -> dict[str, Any]:
        return self._state_of(*self._state_args())

    def state_at_pull(self) -> LazyState:
        """The state :meth:`get_state` would give now, made into its dict only if asked for
        (:meth:`LazyState.resolve`). Pack's cursor takes one at every block it pulls but reads
        only the state before the block it is in when a state is saved (one in several)."""
        return LazyState(self._state_of, self._state_args())

    def _state_args(self) -> tuple[Any, ...]:
        """What the state depends on, taken now (``(source state, consumed, offset, ended)``
        of each source, the tokens, fill, open source, weights and draw counter)."""
        per_source = []
        for i in range(len(self.names)):
            if self._blocks[i] is not None:  # pieces left, or the last one left a document open
                per_source.append(
                    (self._before[i], self._consumed[i], self._offset[i], self._ended[i])
                )
            elif self._ahead[i]:
                per_source.append((self._ahead[i][0][0], 0, 0, self._ended[i]))
            else:
                per_source.append((self.sources[i].state_dict(), 0, 0, self._ended[i]))
        return per_source, tuple(self._tokens), self._fill, self._open, self.weights, self._counter

    def _state_of(
        self,
        sources: list[tuple[Any, int, int, bool]],
        tokens: tuple[int, ...],
        fill: int | None,
        open_source: int | None,
        weights: list[float],
        counter: int,
    ) -> dict[str, Any]:
        """The state dict of :meth:`_state_args`. A source's entry that did not change since
        the last state made is the same dict again (states are never mutated), and so are the
        weights while in force: the state delta skips them without looking inside."""
        per_source = {}
        last = self._last_entries
        for i, name in enumerate(self.names):
            src, consumed, offset, ended = sources[i]
            entry = last[i]
            if (
                entry is None
                or entry[self.SOURCE_KEY] is not src
                or entry[self.CONSUMED_KEY] != consumed
                or entry[self.OFFSET_KEY] != offset
                or entry[self.ENDED_KEY] != ended
            ):
                entry = last[i] = {
                    self.SOURCE_KEY: src,
                    self.CONSUMED_KEY: consumed,
                    self.OFFSET_KEY: offset,
                    self.ENDED_KEY: ended,
                }
            per_source[name] = entry
        if self._last_weights[0] is not weights:
            self._last_weights = (weights, dict(zip(self.names, weights)))
        return {
            self.SOURCES_KEY: per_source,
            self.TOKENS_KEY: dict(zip(self.names, tokens)),
            self.FILL_KEY: fill,
            self.FINISHING_KEY: None if open_source is None else self.names[open_source],
            self.CUTS_BACK_KEY: True,  # handed-back pieces are cut at row ends too
            "weights": self._last_weights[1],  # the weights in force
            self.COUNTER_KEY: counter,
            SETTINGS_KEY: self._settings,
        }

    # -- provenance ----------------------------------------------------------------------------
    def inflight(self) -> list[tuple[str, int, int, int, int]]:
        """Pieces pulled from the sources but not yet emitted, as
        ``(dataset, file, doc, start, stop)``; used to hand them on when rescaling.

        A source whose last pulled piece leaves a document open is first read on to a block
        that ends on a document end, so no source is left in the middle of a document and the
        pieces reported hold the whole rest of it. What the node emits next and its state do
        not change (the blocks read ahead are emitted in turn).
        """
        out: list[tuple[str, int, int, int, int]] = []
        for i, block in enumerate(self._blocks):
            if block is not None and self._consumed[i] < len(block):
                rest = cut_block(block, self._consumed[i], self._offset[i], len(block), 0)
                out.extend(rest.pieces())
            ahead = self._ahead[i]
            tail = ahead[-1][1] if ahead else block
            while tail is not None and len(tail) and not tail.last[-1]:
                before = self.sources[i].state_dict()
                try:
                    tail = next(self.sources[i])
                except StopIteration:
                    break
                ahead.append((before, tail))
            out.extend(p for _, b in ahead for p in b.pieces())
        return out

    def fetch_document(self, dataset: str, file: int, doc: int) -> DocData:
        """Document ``doc`` of file number ``file`` of ``dataset``, as the source that reads
        ``dataset`` delivers it.

        Raises:
            KeyError: no source reads ``dataset``.
        """
        i = self._owner.get(dataset)
        if i is not None:
            return self._fetch(i, dataset, file, doc)
        for i in range(len(self.sources)):
            try:
                data = self._fetch(i, dataset, file, doc)
            except KeyError:
                continue
            self._owner[dataset] = i
            return data
        raise KeyError(
            f"no source of this Interleave reads dataset {dataset!r} (sources: {self.names})"
        )

    def _fetch(self, i: int, dataset: str, file: int, doc: int) -> DocData:
        fetch = getattr(self.sources[i], "fetch_document", None)
        if fetch is None:
            raise KeyError(dataset)
        return fetch(dataset, file, doc)

    # -- internals -----------------------------------------------------------------------------
    def _order(self, saved: list[str] | None) -> None:
        """Order the sources as ``saved`` lists them (a state's order), else as configured.

        The order breaks ties and maps the ``"samples"`` draws to sources, so a state restored
        under a config that lists the same sources in another order must go on in the order it
        was saved in: its first block is replayed by the nodes above and must come out as it
        did. States are matched by name; other names are refused by :meth:`reset`.
        """
        names, sources, weights = self._configured
        if saved is not None and set(saved) == set(names):
            names = [str(n) for n in saved]
        self.names = list(names)
        self.sources = [sources[n] for n in names]
        self._target_weights = [weights[n] for n in names]
        self._owner = {}

    def _ensure_block(self, i: int) -> bool:
        """Give source ``i`` a block with pieces left; False (and mark it ended) if it has none."""
        block = self._blocks[i]
        while block is None or self._consumed[i] >= len(block):
            if self._ahead[i]:
                before, block = self._ahead[i].pop(0)
            else:
                before = self.sources[i].state_dict()
                try:
                    block = next(self.sources[i])
                except StopIteration:
                    self._ended[i] = True
                    self._blocks[i] = None
                    self._consumed[i] = 0
                    return False
            self._blocks[i], self._before[i], self._consumed[i] = block, before, 0
            self._offset[i] = 0
            self._whole[i] = bool(block.last.all())
            self._owner.setdefault(block.dataset, i)
        return True

    def _ratio(self, i: int) -> float:
        return self._tokens[i] / self.weights[i]

    def _pick(self, active: list[int]) -> int:
        """The source the mode's rule picks for the next document (the draw is counted by
        :meth:`_samples_run`)."""
        if self.mode == "samples":
            u = _counter_uniforms(self._key, self._counter, 1)
            return active[int(self._pick_samples(active, u)[0])]
        best, best_ratio = active[0], self._ratio(active[0])
        for i in active[1:]:
            r = self._ratio(i)
            if r < best_ratio:
                best, best_ratio = i, r
        return best

    def _tokens_run(
        self, s: int, active: list[int], block: DocumentBlock, lo: int
    ) -> tuple[int, int]:
        """``(hi, cut)``: the one-at-a-time rule takes pieces ``lo .. hi`` from ``s`` in a row
        (from token ``offset`` of piece ``lo``), and ``cut`` tokens of piece ``hi`` (0: none)."""
        n = len(block)
        others = [i for i in active if i != s]
        if not others:
            return n, 0
        tokens, weights = self._tokens, self.weights
        ratios = [tokens[i] / weights[i] for i in others]  # as _ratio, without its call
        r2 = min(ratios)
        first_at_r2 = others[ratios.index(r2)]  # others ascend: the first listed at r2
        if self.quantum_tokens:
            r2 += self.quantum_tokens / self.weights[s]
        # after taking pieces lo .. lo + j - 1, s is chosen again iff its ratio is below r2, or
        # equal to it and s is listed before every source at r2; or piece lo + j - 1 left its
        # document open (ratios only grow, so the rule holds up to a point, then the run goes
        # on to the end of the document in progress there)
        off = token_offsets(block)
        t, w = self._tokens[s] - off[lo] - self._offset[s], self.weights[s]
        side: Literal["left", "right"] = "right" if s < first_at_r2 else "left"
        end = _ratio_bisect(off, lo + 1, n, t, w, r2, side == "right") - 1  # the rule's last piece
        if self._fill is not None and not (block.stop is not None and self._whole_hand_back):
            anywhere = self._others_open(s)
            cut = self._row_cut(s, block, lo, end, r2, side, anywhere)
            if cut is not None:
                return cut
        if self._whole[s] or block.last[end]:
            return end + 1, 0
        closing = int(block.last[end:].argmax())  # the first piece that ends a document
        return (n if not block.last[end + closing] else end + closing + 1), 0

    def _row_cut(
        self,
        s: int,
        block: DocumentBlock,
        lo: int,
        end: int,
        r2: float,
        side: Any,
        anywhere: bool,
    ) -> tuple[int, int] | None:
        """Where the run ends at a row end (Pack's, mirrored), as ``(hi, cut)`` of
        :meth:`_tokens_run`: the first row end from piece ``end`` on at which the rule would
        not choose ``s`` again. Only inside the document of piece ``end`` (with a token of it
        on each side), or with ``anywhere`` (another source holds a document open, which must
        go on at a row start) at any row end of the block that is not between a document's
        BOS and first token nor between its last token and EOS. None when there is none: the
        run goes on to the document's end (or the block's, and on after it, see ``_emit``)."""
        assert self._mirror is not None and self._fill is not None
        last, n = block.last, len(block)
        if self._whole[s]:  # every piece ends its document
            close = end
        else:
            close = end + int(last[end:].argmax()) if last[end:].any() else n - 1
        skip = self._offset[s]
        stop = (n - 1 if anywhere else close) + 1
        t0, w = self._tokens[s], self.weights[s]
        own = self._mirror.own_layout(block)
        if own is not None:  # in the whole block's stream, from the run's start on
            tok = own.tok
            at = first_row_end(
                tok, own.off, own.bos, None, own.offset(lo, skip), tok[lo] + skip, end, stop,
                self._fill, self._capacity, t0, w, r2, side,
            )  # fmt: skip
            if at is None:
                return None
            j, t = at
            return (j + 1, 0) if t == tok[j + 1] - tok[j] else (j, t)
        rest = cut_block(block, lo, skip, stop, 0)  # pins (a hand-back) restart the rows
        units = self._mirror.units(rest, peek=True)
        at = first_row_end(
            rest.offsets.tolist(), units.off.tolist(), units.bos.tolist(), units.pin_at, 0, 0,
            end - lo, len(rest), self._fill, self._capacity, t0, w, r2, side,
        )  # fmt: skip
        if at is None:
            return None
        j, t = at
        if t == rest.lengths[j]:  # after the piece
            return lo + j + 1, 0
        return lo + j, t + (skip if j == 0 else 0)

    def _holds_open(self, i: int) -> bool:
        """Whether source ``i``'s last emitted piece left its document open."""
        block, c = self._blocks[i], self._consumed[i]
        if block is None or self._offset[i] > 0:
            return block is not None
        return c > 0 and not self._whole[i] and not block.last[c - 1]

    def _others_open(self, s: int) -> bool:
        """Whether a source other than ``s`` holds a document open (:meth:`_holds_open`)."""
        for i in range(len(self._blocks)):
            if i != s and self._blocks[i] is not None and self._holds_open(i):
                return True
        return False

    def _pick_samples(self, active: list[int], u: np.ndarray) -> np.ndarray:
        """Positions in ``active`` of the sources draws ``u`` pick."""
        cw = np.cumsum([self.weights[i] for i in active])
        pos = np.searchsorted(cw, u * cw[-1], side="right")
        return np.minimum(pos, len(active) - 1)

    def _samples_run(
        self, s: int, active: list[int], block: DocumentBlock, lo: int, drawn: bool
    ) -> tuple[int, int]:
        """``(pieces, draws)``: the pieces from ``lo`` that ``s`` gives in a row, one draw per
        document, and the draws they take. The first document's draw (made, ``drawn``) picked
        ``s``, or it is the rest of a document in progress and takes none."""
        n = len(block)
        if self._whole[s]:  # whole documents (the usual case): a piece is a document
            starts = None
            docs = n - lo
        else:  # document d starts at piece starts[d]; the block may end inside the last one
            ends = np.flatnonzero(block.last[lo:n])
            starts = np.concatenate(([0], ends[ends < n - lo - 1] + 1))
            docs = len(starts)
        skip = 0 if drawn else 1  # documents that take no draw
        u = _counter_uniforms(self._key, self._counter, docs - skip)
        other = np.flatnonzero(self._pick_samples(active, u) != active.index(s))
        taken = int(other[0]) + skip if len(other) else docs
        pieces = n - lo if taken >= docs else (taken if starts is None else int(starts[taken]))
        return pieces, taken - skip

    def _emit(
        self, s: int, block: DocumentBlock, lo: int, hi: int, cut: int, resuming: bool
    ) -> DocumentBlock:
        """Pieces ``lo .. hi`` of ``s``'s block (from its ``offset``) and ``cut`` tokens of
        piece ``hi``; the mirrored row position moves on over them. A document left open at
        a row end and ``resuming`` mid-row (only after a finite source ended mid-row) goes on
        there; when Pack pins continuations to row starts (no EOS) it is marked handed back
        (``stop``), so Pack starts it on a new row, as after a rescale."""
        skip = self._offset[s]
        span = None
        out: DocumentBlock
        if resuming and self._fill and self._mirror is not None and self._mirror.pin_continuations:
            out = cut_block(block, lo, skip, hi, cut)
            out = dataclasses.replace(out, stop=out.start + out.lengths)
        else:  # Pack's cursor slices the stream of the whole block (laid out once)
            out = RunBlock(block, lo, skip, hi, cut, token_offsets(block))
            if self._mirror is not None:
                span = self._mirror.span(block, lo, skip, hi, cut)
        self._tokens[s] += out.num_tokens
        self._consumed[s], self._offset[s] = hi, cut
        left_open = cut > 0 or (not self._whole[s] and not block.last[hi - 1])
        if self._fill is None:  # documents whole: one left open goes on now
            self._open = s if left_open else None
        else:  # a row left open goes on now, as does a document cut mid-row
            assert self._mirror is not None
            if span is not None:  # the run is tokens span[0] .. span[1] of the block's stream
                self._fill = (self._fill + span[1] - span[0]) % self._capacity
            else:
                self._fill = fill_after(self._mirror.units(out), self._fill, self._capacity)
            self._open = s if self._fill and (left_open or self._others_open(s)) else None
            if left_open and block.stop is not None and self._whole_hand_back:
                self._open = s  # a state from before hand-back cuts: its first block as then
        if hi >= len(block) and not left_open:
            self._blocks[s] = None  # get_state takes the source's state after it
            self._consumed[s] = 0
        self._whole_hand_back = False  # only the block a restore replays is decided as then
        return out
