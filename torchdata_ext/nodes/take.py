"""The budget node: end a stream of document blocks after exactly N tokens or N documents.

``Take`` sits on any node yielding :class:`~torchdata_ext.document.DocumentBlock` s: on a
reader (a per-dataset budget), on an interleave (a per-phase or per-run budget), or on a
:class:`~torchdata_ext.nodes.concat.Concat`. It passes whole blocks through until the budget
runs out inside one, emits the head of that block and ends (``StopIteration``), so the nodes
above finish a finite run as usual: ``Pack`` flushes its last partial sequence, the shuffle
buffer drains, ``Collate`` emits the last partial batch.

**The budget is per run, split exactly among the global workers.** With ``max_tokens=N`` over
``ranks x workers = T`` global workers, global worker ``g`` gets ``N // T + (g < N % T)``
tokens, so the shares sum to exactly ``N`` whatever the topology. A per-worker budget would
change the run's total with every change of topology; a per-run one is what a training plan
states ("anneal on 2B tokens"). A worker whose shards run out first delivers less (a budget is
a cap, not a promise). On a rescale the *remaining* budget of each old worker is re-split among
the new workers that take over its logical shards, as interleave token counters are
(:func:`torchdata_ext.checkpoint.rescale.rescale_worker_states`), plus the tokens (documents) the nodes
above held in flight: those go back to the readers and pass this node again, so they are
credited back. The new workers' remaining budgets sum to exactly what was left.

**What counts.** ``max_tokens`` counts document tokens as the source delivers them (after
``strip_tokens``, before Pack's BOS/EOS and padding), the tokens a provenance table records.
``max_documents`` counts document starts (pieces with ``start == 0``); the pieces of a document
cut by ``max_chunksize`` that follow its start pass free, so the N-th document is delivered
whole, and the stream ends before the (N + 1)-th begins.

**The cut is exact in tokens.** When ``max_tokens`` runs out inside a document, that
document's first tokens up to the budget are emitted (its piece has ``last`` False: the
document did not end, so Pack places no EOS after it) and the rest is not delivered in this
run. The pieces of the block after the cut are held, not dropped: :meth:`inflight` reports
them, so a rescale hands them back to their shards and a new worker with budget left delivers
them (nothing of the epoch is lost to a worker that stopped early). ``max_documents`` cuts at a
document start only.

State::

    {"name": str,                        # matches the budget across workers on a rescale
     "remaining_tokens": int | None,     # budget left (None: no token budget)
     "remaining_documents": int | None,
     "source": <source state; before the cut block when "cut" is set>,
     "cut": None | [pieces, tokens]}     # the head emitted of the last block: whole pieces
                                         # plus tokens of the next one

Replay, don't copy: after the cut the state holds the source's state before that block and
where it was cut; a restore pulls the block again and holds its tail. Resume guarantee:
restoring a state continues with exactly the blocks the uninterrupted run would have produced.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.checks import check_int
from torchdata_ext.document import DocumentBlock
from torchdata_ext.handlers.base import DocData
from torchdata_ext.state.settings import SETTINGS_KEY, check_settings
from torchdata_ext.world import World

__all__ = ["Take", "budget_share"]

_Piece = tuple[str, int, int, int, int]


def budget_share(total: int, world: World) -> int:
    """Global worker ``world.global_worker``'s share of a run budget of ``total``: the shares
    of all ``world.total_workers`` workers sum to exactly ``total``."""
    n, g = world.total_workers, world.global_worker
    return total // n + (g < total % n)


class Take(BaseNode[DocumentBlock]):
    """Pass document blocks until a budget of tokens or documents is used up, then end.

    Args:
        source: a node yielding :class:`~torchdata_ext.document.DocumentBlock` s (token blocks
            for ``max_tokens``; text blocks work with ``max_documents`` only).
        max_tokens: document tokens for the whole run (all ranks x workers together); None for
            no token budget.
        max_documents: documents for the whole run (counted at their first piece); None for
            no document budget. With both, the stream ends at whichever runs out first.
        name: the budget's name, unique in a graph: a rescale matches budget states across
            workers by it (e.g. ``"run"``, ``"phase1"``, a dataset name).
        world: this copy's place among all copies, which decides its share of the budget;
            default: detected when iteration starts (as the readers do).

    Raises:
        ValueError: neither budget given, or one < 0; ``name`` empty.
        TypeError: ``source`` is not a node, a budget is not an integer.
    """

    SOURCE_KEY = "source"
    NAME_KEY = "name"
    TOKENS_KEY = "remaining_tokens"
    DOCUMENTS_KEY = "remaining_documents"
    CUT_KEY = "cut"

    def __init__(
        self,
        source: BaseNode[DocumentBlock],
        *,
        max_tokens: int | None = None,
        max_documents: int | None = None,
        name: str = "budget",
        world: World | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(source, BaseNode):
            raise TypeError(f"source={source!r} must be a torchdata.nodes.BaseNode")
        if max_tokens is None and max_documents is None:
            raise ValueError("Take needs max_tokens or max_documents (or both); neither was given")
        self.max_tokens = None if max_tokens is None else check_int("max_tokens", max_tokens, 0)
        self.max_documents = (
            None if max_documents is None else check_int("max_documents", max_documents, 0)
        )
        if not isinstance(name, str) or not name:
            raise ValueError(f"{name=} must be a non-empty string (it keys the budget's state)")
        self.source = source
        self.name = name
        # the run's budget the saved shares are of (see state/settings.py); never mutated
        self._settings = {"max_tokens": self.max_tokens, "max_documents": self.max_documents}
        self._given_world = world
        self.world: World | None = None
        self._tokens: int | None = None
        self._docs: int | None = None
        self._cut: list[int] | None = None  # [pieces, tokens] of the block's head emitted
        self._before: Any = None  # the source's state before the cut block
        self._tail: list[_Piece] = []  # pieces of the cut block not emitted
        self._ended = False
        self._src_state: Any = None  # the source's state since the last pull, once taken

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.world = self._given_world or World.detect()
        self._cut, self._before, self._tail, self._ended = None, None, [], False
        self._src_state = None
        if initial_state is None:
            self.source.reset()
            share = budget_share
            self._tokens = None if self.max_tokens is None else share(self.max_tokens, self.world)
            self._docs = (
                None if self.max_documents is None else share(self.max_documents, self.world)
            )
            return
        if initial_state[self.NAME_KEY] != self.name:
            raise ValueError(
                f"this Take state is of budget {initial_state[self.NAME_KEY]!r}, not "
                f"{self.name!r}; restore with the same graph"
            )
        tokens, docs = initial_state[self.TOKENS_KEY], initial_state[self.DOCUMENTS_KEY]
        if (tokens is None) != (self.max_tokens is None) or (docs is None) != (
            self.max_documents is None
        ):
            raise ValueError(
                f"budget {self.name!r}: the state has remaining_tokens={tokens}, "
                f"remaining_documents={docs} but this node has max_tokens={self.max_tokens}, "
                f"max_documents={self.max_documents}; a budget cannot be added or removed "
                "across a checkpoint"
            )
        check_settings(f"Take (budget {self.name!r})", initial_state, self._settings)
        self._tokens = None if tokens is None else int(tokens)
        self._docs = None if docs is None else int(docs)
        self.source.reset(initial_state[self.SOURCE_KEY])
        cut = initial_state[self.CUT_KEY]
        if cut is not None:  # replay the cut block to hold its tail again
            self._before = initial_state[self.SOURCE_KEY]
            self._cut = [int(cut[0]), int(cut[1])]
            try:
                block = next(self.source)
            except StopIteration:
                block = None
            if block is None or len(block) <= self._cut[0]:
                raise ValueError(
                    f"budget {self.name!r}: the block read again on restore has "
                    f"{0 if block is None else len(block)} pieces but the state cut it after "
                    f"{self._cut[0]}; the data or the source's configuration changed since the "
                    "checkpoint was taken"
                )
            self._tail = _tail_pieces(block, *self._cut)
            self._ended = True

    def next(self) -> DocumentBlock:
        if self._ended or self._tokens == 0:
            self._ended = True
            raise StopIteration
        # the node above usually took this node's state just before (Pack does, per block)
        before = self._src_state if self._src_state is not None else self.source.state_dict()
        self._src_state = None
        block = next(self.source)  # the source's end is this node's end
        pieces, extra = self._cut_at(block)
        if pieces == len(block):
            self._spend(block)
            return block
        self._before, self._cut, self._ended = before, [pieces, extra], True
        self._tail = _tail_pieces(block, pieces, extra)
        head = _head(block, pieces, extra)
        self._spend(head)
        if len(head) == 0:
            raise StopIteration
        return head

    def get_state(self) -> dict[str, Any]:
        if self._cut is not None:
            src = self._before
        else:
            if self._src_state is None:
                self._src_state = self.source.state_dict()
            src = self._src_state
        return {
            self.NAME_KEY: self.name,
            self.TOKENS_KEY: self._tokens,
            self.DOCUMENTS_KEY: self._docs,
            self.SOURCE_KEY: src,
            self.CUT_KEY: list(self._cut) if self._cut is not None else None,
            SETTINGS_KEY: self._settings,
        }

    # -- provenance / rescale ------------------------------------------------------------------
    @property
    def remaining(self) -> tuple[int | None, int | None]:
        """``(tokens, documents)`` of this worker's budget share not yet delivered (None where
        that budget is not set)."""
        return self._tokens, self._docs

    def inflight(self) -> list[_Piece]:
        """The pieces of the cut block after the cut, as ``(dataset, file, doc, start, stop)``:
        pulled from the source, never emitted (a rescale hands them back to their shards)."""
        return list(self._tail)

    def fetch_document(self, dataset: str, file: int, doc: int) -> DocData:
        """Document ``doc`` of file ``file`` of ``dataset``, as the source delivers it."""
        fetch = getattr(self.source, "fetch_document", None)
        if fetch is None:
            raise KeyError(dataset)
        return fetch(dataset, file, doc)

    # -- internals -----------------------------------------------------------------------------
    def _cut_at(self, block: DocumentBlock) -> tuple[int, int]:
        """Where the budget ends in ``block``: ``(whole pieces, tokens of the next piece)``;
        ``(len(block), 0)`` when all of it fits."""
        n = len(block)
        cut = (n, 0)
        if self._docs is not None:
            starts = np.cumsum(block.start == 0)
            if n and int(starts[-1]) > self._docs:  # piece p starts document docs + 1
                cut = (int(np.searchsorted(starts, self._docs, side="right")), 0)
        if self._tokens is not None:
            if block.tokens is None:
                raise TypeError(
                    f"budget {self.name!r}: max_tokens needs token blocks but dataset "
                    f"{block.dataset!r} arrives as text; put Take after Tokenize"
                )
            off = block.offsets
            if int(off[-1]) > self._tokens:
                p = int(np.searchsorted(off, self._tokens, side="right")) - 1
                cut = min(cut, (p, self._tokens - int(off[p])))
        return cut

    def _spend(self, block: DocumentBlock) -> None:
        if self._tokens is not None:
            self._tokens -= int(block.offsets[-1])
        if self._docs is not None:
            self._docs -= int(np.count_nonzero(block.start == 0))


def _head(block: DocumentBlock, pieces: int, extra: int) -> DocumentBlock:
    """Pieces ``0 .. pieces`` of ``block`` plus the first ``extra`` tokens of the next one
    (marked ``last`` False: its document goes on)."""
    if not extra:
        return block.select(0, pieces)
    head = block.select(0, pieces + 1)
    assert head.tokens is not None  # extra > 0 only for token budgets
    offsets = head.offsets.copy()
    offsets[-1] = offsets[-2] + extra
    last = head.last.copy()
    last[-1] = False
    return DocumentBlock(
        head.dataset,
        head.tokens[: int(offsets[-1])],
        None,
        offsets,
        head.file,
        head.doc,
        head.start,
        last,
        head.shard,
        head.epoch,
    )


def _tail_pieces(block: DocumentBlock, pieces: int, extra: int) -> list[_Piece]:
    """The pieces of ``block`` after its head (see :func:`_head`)."""
    out = block.select(pieces, len(block)).pieces()
    if extra:
        ds, f, d, start, stop = out[0]
        out[0] = (ds, f, d, start + extra, stop)
    return out
