"""The interleave node: mix several sources of document blocks at chosen weights.

Two rules pick the source of each next document (a piece of a block; pieces are never split):

* ``"tokens"`` (deterministic, as in Bamba): the source furthest below its target share of
  tokens, i.e. the active source with the lowest ``tokens_delivered[s] / weight[s]``; ties go to
  the source listed first. Instead of deciding document by document in Python, the node takes in
  one step the longest run of the chosen source's current block for which the rule would have
  kept choosing it (a ``searchsorted`` on the block's cumulative lengths against the
  second-lowest ratio), which gives exactly the same sequence of documents.
* ``"samples"`` (random): draw ``k`` picks source ``s`` with probability ``weight[s] / sum of
  the active weights``. Draw ``k`` is a pure function of ``(seed, k)``: uniform ``u_k`` is the
  SplitMix64 finalizer of ``key + (k + 1) * 0x9E3779B97F4A7C15`` (``key = mix_seed(seed, tag)``)
  scaled to ``[0, 1)``, computed for many ``k`` at once with NumPy, so the state holds only the
  counter ``k``. Runs of consecutive draws of the same source come out as one block. Weights
  count documents here, not tokens.

Each output block is a zero-copy :meth:`~torchdata_ext.document.DocumentBlock.select` of one
source's block, so it holds one dataset and keeps the source's ``shard`` and ``epoch``. Endless
sources (readers with ``epochs=None``) go through their own epochs; a finite source that raises
``StopIteration`` is dropped and the mix goes on with the rest, until all have ended.

State (replay, no token copies)::

    {"sources": {name: {"source": <its state before its current block>,
                        "consumed": <pieces of that block already emitted>,
                        "ended": bool}},
     "tokens_delivered": {name: int},
     "counter": int}

On restore each source is reset to its saved state, its current block is read again and the
``consumed`` pieces are skipped. Resume guarantee: restoring a state continues with exactly the
blocks the uninterrupted run would have produced next. ``tokens_delivered`` is plain
``name -> int`` so it can be summed and re-split across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.document import DocumentBlock
from torchdata_ext.handlers.base import DocData
from torchdata_ext.walk import mix_seed

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


class Interleave(BaseNode[DocumentBlock]):
    """Mix sources of :class:`~torchdata_ext.document.DocumentBlock` s at chosen weights.

    Args:
        sources: name -> node; the order breaks ties in ``"tokens"`` mode. Names key the state.
        weights: name -> weight (> 0, need not sum to 1), one per source.
        mode: ``"tokens"``: each source gets ``weight / sum(weights)`` of the tokens
            (deterministic); ``"samples"``: each document is drawn from a source with probability
            proportional to its weight (seeded).
        seed: the seed of the ``"samples"`` draws.
        quantum_tokens: ``"tokens"`` mode only: keep taking from the chosen source until it is
            this many tokens past the next source's share (0, the default: decide document by
            document, as Bamba). A few thousand tokens cuts the per-decision overhead when
            documents are short; any share stays within ``(quantum_tokens + longest document)
            / tokens delivered`` of its target.

    Raises:
        ValueError: no sources, a weight <= 0 (or not finite), a missing or extra weight, or an
            unknown mode.
    """

    SOURCES_KEY = "sources"
    SOURCE_KEY = "source"
    CONSUMED_KEY = "consumed"
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
        self._switch_weights = False
        self.mode = mode
        self.seed = int(seed)
        self._key = mix_seed(self.seed, _SAMPLES_TAG)
        n = len(self.names)
        self._blocks: list[DocumentBlock | None] = [None] * n
        self._before: list[Any] = [None] * n  # source state before its current block
        self._consumed = [0] * n
        self._ended = [False] * n
        self._tokens = [0] * n
        self._counter = 0
        self._owner: dict[str, int] = {}  # dataset name -> source index, learned from blocks

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        n = len(self.names)
        self._blocks = [None] * n
        self._before = [None] * n
        self._consumed = [0] * n
        self._ended = [False] * n
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
        for i, name in enumerate(self.names):
            st = per_source[name]
            self.sources[i].reset(st[self.SOURCE_KEY])
            self._ended[i] = bool(st[self.ENDED_KEY])
            consumed = int(st[self.CONSUMED_KEY])
            if consumed == 0 or self._ended[i]:
                continue
            try:
                block = next(self.sources[i])
            except StopIteration:
                block = None
            if block is None or len(block) <= consumed:
                raise ValueError(
                    f"source {name!r}: the block read again on restore has "
                    f"{0 if block is None else len(block)} pieces but the state says {consumed} "
                    "were already delivered; the data or the source's configuration changed "
                    "since the checkpoint was taken"
                )
            self._blocks[i] = block
            self._before[i] = st[self.SOURCE_KEY]
            self._consumed[i] = consumed
            self._owner.setdefault(block.dataset, i)

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
                    self.weights, self._switch_weights = list(self._target_weights), False
            if self.mode == "tokens":
                s = self._pick_tokens(active)
            else:
                u = float(_counter_uniforms(self._key, self._counter, 1)[0])
                s = active[self._pick_samples(active, np.array([u]))[0]]
            if not self._ensure_block(s):
                continue  # s ended: decide again among the others
            block = self._blocks[s]
            assert block is not None
            lo = self._consumed[s]
            if self.mode == "tokens":
                count = self._tokens_run(s, active, block, lo)
            else:
                count = self._samples_run(s, active, len(block) - lo)
                self._counter += count
            out = self._emit(s, block, lo, lo + count)
            if self._switch_weights:
                self.weights, self._switch_weights = list(self._target_weights), False
            return out

    def get_state(self) -> dict[str, Any]:
        per_source = {}
        for i, name in enumerate(self.names):
            block = self._blocks[i]
            if block is not None and self._consumed[i] < len(block):
                src, consumed = self._before[i], self._consumed[i]
            else:
                src, consumed = self.sources[i].state_dict(), 0
            per_source[name] = {
                self.SOURCE_KEY: src,
                self.CONSUMED_KEY: consumed,
                self.ENDED_KEY: self._ended[i],
            }
        return {
            self.SOURCES_KEY: per_source,
            self.TOKENS_KEY: dict(zip(self.names, self._tokens)),
            "weights": dict(zip(self.names, self.weights)),  # the weights in force
            self.COUNTER_KEY: self._counter,
        }

    # -- provenance ----------------------------------------------------------------------------
    def inflight(self) -> list[tuple[str, int, int, int, int]]:
        """Pieces pulled from the sources but not yet emitted, as
        ``(dataset, file, doc, start, stop)``; used to hand them on when rescaling."""
        out: list[tuple[str, int, int, int, int]] = []
        for i, block in enumerate(self._blocks):
            if block is not None and self._consumed[i] < len(block):
                out.extend(block.select(self._consumed[i], len(block)).pieces())
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
    def _ensure_block(self, i: int) -> bool:
        """Give source ``i`` a block with pieces left; False (and mark it ended) if it has none."""
        block = self._blocks[i]
        while block is None or self._consumed[i] >= len(block):
            before = self.sources[i].state_dict()
            try:
                block = next(self.sources[i])
            except StopIteration:
                self._ended[i] = True
                self._blocks[i] = None
                self._consumed[i] = 0
                return False
            self._blocks[i], self._before[i], self._consumed[i] = block, before, 0
            self._owner.setdefault(block.dataset, i)
        return True

    def _ratio(self, i: int) -> float:
        return self._tokens[i] / self.weights[i]

    def _pick_tokens(self, active: list[int]) -> int:
        best, best_ratio = active[0], self._ratio(active[0])
        for i in active[1:]:
            r = self._ratio(i)
            if r < best_ratio:
                best, best_ratio = i, r
        return best

    def _tokens_run(self, s: int, active: list[int], block: DocumentBlock, lo: int) -> int:
        """How many pieces from ``lo`` the one-at-a-time rule would take from ``s`` in a row."""
        n = len(block)
        others = [i for i in active if i != s]
        if not others:
            return n - lo
        r2 = min(self._ratio(i) for i in others)
        first_at_r2 = min(i for i in others if self._ratio(i) == r2)
        if self.quantum_tokens:
            r2 += self.quantum_tokens / self.weights[s]
        # after taking pieces lo .. lo + j - 1, s is chosen again iff its ratio is below r2, or
        # equal to it and s is listed before every source at r2
        off = block.offsets
        ratios = (off[lo + 1 : n] + (self._tokens[s] - int(off[lo]))) / self.weights[s]
        side: Literal["left", "right"] = "right" if s < first_at_r2 else "left"
        return 1 + int(np.searchsorted(ratios, r2, side=side))

    def _pick_samples(self, active: list[int], u: np.ndarray) -> np.ndarray:
        """Positions in ``active`` of the sources draws ``u`` pick."""
        cw = np.cumsum([self.weights[i] for i in active])
        pos = np.searchsorted(cw, u * cw[-1], side="right")
        return np.minimum(pos, len(active) - 1)

    def _samples_run(self, s: int, active: list[int], left: int) -> int:
        """How many of the next draws (at most ``left``) pick ``s`` in a row (the first does)."""
        u = _counter_uniforms(self._key, self._counter, left)
        other = np.flatnonzero(self._pick_samples(active, u) != active.index(s))
        return int(other[0]) if len(other) else left

    def _emit(self, s: int, block: DocumentBlock, lo: int, hi: int) -> DocumentBlock:
        out = block.select(lo, hi)
        self._tokens[s] += int(block.offsets[hi] - block.offsets[lo])
        self._consumed[s] = hi
        if hi >= len(block):
            self._blocks[s] = None  # get_state takes the source's state after it
            self._consumed[s] = 0
        return out
