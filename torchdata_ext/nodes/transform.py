"""The document transform node: maps and filters between the reader (or tokenize) and interleave.

:class:`TransformDocuments` applies a chain of :mod:`~torchdata_ext.transforms` steps to each
block, as whole documents; :class:`MapDocuments` and :class:`FilterDocuments` are the same node
built from one function (they live here, with it, as two constructors of one node). A transform
node put on another one takes its place with the two chains joined, so a graph holds at most
one transform node per source and the chain is applied in one pass::

    reader ─► [text transforms] ─► tokenize ─► [token transforms] ─► interleave ─► pack

Exactness (restore, rescale) rests on three rules:

* **Whole documents.** A step always sees whole documents. A document the reader cut into
  pieces (``max_chunksize``) is read again whole (``fetch_document``) when its first piece
  arrives, transformed, and, if kept, emitted at once cut into pieces of the first piece's
  length; the source's later pieces of it are skipped (the state records the document being
  skipped). So a filter drops all pieces of a dropped document, a map applies to all of it.
* **Provenance is in transformed coordinates.** ``fetch_document`` returns the transformed
  document, so the shuffle buffer rebuilds what was emitted. Pieces handed back by a rescale
  (``start .. stop`` of the transformed document) come from the reader (or tokenize) marked by
  ``DocumentBlock.stop``: the node reads each document again, transforms it and cuts the piece.
* **Deterministic functions.** A dropped document counts as consumed (it is never delivered);
  a mapped one is rebuilt by applying the functions again. The first block is transformed
  twice and the results compared (``ValueError`` naming the step if they differ).

State: ``{"source": <the source's state after the last block this node used>, "skip":
[file, doc] of a cut document whose remaining source pieces are to be skipped, or None,
"settings": {"transforms": [each step's identity: a built-in's name and arguments, a user's
step's kind, name and function]}}``; a restore whose steps or their parameters differ is refused
naming the step and the parameter (:mod:`~torchdata_ext.state.settings`).
Resume guarantee: restoring continues with exactly the blocks the uninterrupted run would have
produced. Rescaling: :meth:`inflight` first reads the source on to the end of a document being
skipped (so the reader's cursor lies between documents), and reports the pieces it read ahead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.checks import check_int
from torchdata_ext.document import DocumentBlock, handed_back_piece
from torchdata_ext.handlers.base import DocData
from torchdata_ext.nodes.drops import DEFAULT_MAX_DROPPED, DropWatch, readers_pass
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.state.graph import graph_nodes
from torchdata_ext.state.settings import SETTINGS_KEY, check_settings
from torchdata_ext.transforms import Filter, Map, On, Transform, TransformError, from_spec

__all__ = ["FilterDocuments", "MapDocuments", "TransformDocuments"]


def _same(a: DocumentBlock, b: DocumentBlock) -> bool:
    if not np.array_equal(a.offsets, b.offsets) or not np.array_equal(a.doc, b.doc):
        return False
    if not np.array_equal(a.file, b.file):
        return False
    if a.tokens is not None:
        return b.tokens is not None and np.array_equal(a.tokens, b.tokens)
    return a.texts == b.texts


def _concat(blocks: list[DocumentBlock], like: DocumentBlock) -> DocumentBlock:
    """Blocks of one dataset joined into one (``like`` gives the dataset, shard and epoch)."""
    blocks = [b for b in blocks if len(b)]
    if len(blocks) == 1:
        return blocks[0]
    lengths = [b.offsets[1:] - b.offsets[:-1] for b in blocks]
    flat_len = np.concatenate(lengths) if blocks else np.zeros(0, np.int64)
    offsets = np.zeros(len(flat_len) + 1, np.int64)
    np.cumsum(flat_len, out=offsets[1:])

    def cat(name: str, dtype: Any) -> np.ndarray:
        parts = [getattr(b, name) for b in blocks]
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

    tokens = texts = None
    if like.tokens is not None:
        tokens = np.concatenate([b.tokens for b in blocks]) if blocks else like.tokens[:0]
    else:
        texts = [t for b in blocks for t in (b.texts or [])]
    stop = None
    if any(b.stop is not None for b in blocks):
        stop = np.concatenate(
            [b.stop if b.stop is not None else np.full(len(b), -1, np.int64) for b in blocks]
        )
    return DocumentBlock(
        like.dataset,
        tokens,
        texts,
        offsets,
        cat("file", np.int32),
        cat("doc", np.int64),
        cat("start", np.int64),
        cat("last", bool),
        like.shard,
        like.epoch,
        stop,
    )


class TransformDocuments(BaseNode[DocumentBlock]):
    """Apply maps and filters to whole documents of a block stream (see the module docstring).

    Args:
        source: a node of :class:`~torchdata_ext.document.DocumentBlock` s that can fetch
            documents again (a :class:`~torchdata_ext.nodes.reader.ShardReader`, a
            :class:`~torchdata_ext.nodes.tokenize.Tokenize`). A ``TransformDocuments`` source is
            absorbed: this node reads from its source, its steps first.
        transforms: the steps, applied in order: :class:`~torchdata_ext.transforms.Map`,
            :class:`~torchdata_ext.transforms.Filter`, callables (per-document maps) or built-in
            specs such as ``{"min_length": 32}`` (see :func:`~torchdata_ext.transforms.from_spec`).
            All work on tokens, or all on text (a text chain goes before tokenize).
        check_deterministic: apply each step twice to the first block and raise ``ValueError``
            if the results differ (cheap; turn off only for costly functions known to be pure).
        max_dropped: on an endless source, fail (:class:`~torchdata_ext.nodes.drops.
            NothingKeptError`, naming each step's drops) after this many documents in a row
            dropped or emptied by the steps, or after a whole pass over the source's documents
            (twice what its readers own) with none kept, instead of pulling forever (default one
            million; None: only the whole pass). Almost everything dropped warns once
            (:mod:`torchdata_ext.nodes.drops`).
        max_id: the largest token id a token step may return (the tokenizer's vocabulary and
            the special ids; None: any id >= 0). A map's output is checked once per block (one
            min and one max): an id < 0 or > ``max_id`` raises ``ValueError`` naming the step
            and the first document holding one.
        ids_from: what ``max_id`` comes from, for that message (``"the vocabulary of ..."``).

    Raises:
        TypeError / ValueError: a bad step, or steps on both tokens and text.
    """

    SOURCE_KEY = "source"
    SKIP_KEY = "skip"
    source: BaseNode[DocumentBlock]
    steps: list[Transform]

    def __init__(
        self,
        source: BaseNode[DocumentBlock],
        transforms: Sequence[Any],
        *,
        check_deterministic: bool = True,
        max_dropped: int | None = DEFAULT_MAX_DROPPED,
        max_id: int | None = None,
        ids_from: str = "",
    ) -> None:
        super().__init__()
        self.max_id, self.ids_from = max_id, ids_from
        if not isinstance(source, BaseNode):
            raise TypeError(f"source must be a torchdata.nodes.BaseNode, got {type(source)!r}")
        if isinstance(transforms, (Transform, dict)) or callable(transforms):
            transforms = [transforms]
        steps: list[Transform] = []
        if isinstance(source, TransformDocuments):
            steps, source = list(source.steps), source.source
        on: On = steps[0].on if steps else "tokens"
        for spec in transforms:
            if not steps and isinstance(spec, Transform):
                on = spec.on
            steps.append(from_spec(spec, on))
        if not steps:
            raise ValueError("transforms is empty; pass at least one Map, Filter or spec")
        kinds = {s.on for s in steps}
        if len(kinds) > 1:
            raise ValueError(
                f"transforms {steps} mix text and token steps; put the text steps in a node "
                "before Tokenize and the token steps in a node after it"
            )
        self.source = source
        self.steps: list[Transform] = steps
        self.on: On = steps[0].on
        self._settings = {"transforms": [step.identity() for step in steps]}  # never mutated
        self.check_deterministic = bool(check_deterministic)
        self._checked = not self.check_deterministic
        self._source_state: Any = None
        self._skip: list[int] | None = None  # as of the last block emitted (the state)
        self._live_skip: list[int] | None = None  # as of the last block read from the source
        self._ahead: list[tuple[DocumentBlock | None, Any, list[int] | None]] = []
        if max_dropped is not None:
            check_int("max_dropped", max_dropped, 1)
        self.max_dropped = max_dropped
        self._dropped_by: dict[str, int] = {}  # per step name: documents dropped, for messages
        self._emptied = 0  # documents the steps left with no data
        self._stage_named = False
        self._drops = DropWatch(
            f"the transforms {steps}",
            max_dropped,
            "check the filters and maps (a filter's True keeps a document), or raise "
            "max_dropped_documents if they are meant to be this selective",
        )

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._ahead = []
        if initial_state is not None:
            check_settings("TransformDocuments", initial_state, self._settings)
            self.source.reset(initial_state[self.SOURCE_KEY])
            skip = initial_state[self.SKIP_KEY]
            self._skip = None if skip is None else [int(x) for x in skip]
        else:
            self.source.reset()
            self._skip = None
        self._live_skip = self._skip
        self._source_state = self.source.state_dict()
        endless, cycle = readers_pass(self.source)
        self._dropped_by, self._emptied = {}, 0
        self._drops.reset(endless=endless, cycle=cycle)

    def next(self) -> DocumentBlock:
        while True:
            if self._ahead:
                out, self._source_state, self._skip = self._ahead.pop(0)
            else:
                block = next(self.source)
                out = self._process(block)
                self._source_state, self._skip = self.source.state_dict(), self._live_skip
                self._count(block, out)
            if out is not None and len(out):
                return out

    def _count(self, block: DocumentBlock, out: DocumentBlock | None) -> None:
        """Documents read (first pieces) and kept (with data) for the drop watch."""
        read = len(block) if block.stop is not None else int((block.start == 0).sum())
        kept = 0
        if out is not None and len(out):
            firsts = out.start == 0
            kept = int((firsts & (out.offsets[1:] > out.offsets[:-1])).sum())
            self._emptied += int(firsts.sum()) - kept
        if not self._stage_named:  # the dataset is known from the first block
            self._drops.stage = f"dataset {block.dataset!r}: {self._drops.stage}"
            self._stage_named = True
        self._drops.count(read, kept, self._why_dropped)

    def _why_dropped(self) -> str:
        parts = [f"step {name!r} dropped {n:,}" for name, n in self._dropped_by.items() if n]
        if self._emptied:
            parts.append(f"{self._emptied:,} came out of the steps with no data")
        return "; ".join(parts)

    def get_state(self) -> dict[str, Any]:
        return {
            self.SOURCE_KEY: self._source_state,
            self.SKIP_KEY: self._skip,
            SETTINGS_KEY: self._settings,
        }

    # -- provenance ----------------------------------------------------------------------------
    def inflight(self) -> list[tuple[str, int, int, int, int]]:
        """Pieces read from the source and transformed but not yet emitted, as ``(dataset,
        file, doc, start, stop)`` in transformed coordinates. A document being skipped (its
        pieces already emitted whole) is first read on to its end, so the source's cursor
        lies between documents; the blocks read ahead are emitted in turn, as they would be."""
        while self._live_skip is not None:
            try:
                block = next(self.source)
            except StopIteration:
                break
            out = self._process(block)
            self._ahead.append((out, self.source.state_dict(), self._live_skip))
        return [p for out, _, _ in self._ahead if out is not None for p in out.pieces()]

    def fetch_document(self, dataset: str, file: int, doc: int) -> DocData:
        """Document ``doc`` of file number ``file`` of ``dataset`` as this node delivers it:
        read again from the source and transformed.

        Raises:
            ValueError: the steps drop it now (they are not deterministic, or the data changed).
        """
        data = self._fetch_source(dataset, file, doc)
        block = _one(dataset, file, doc, data)
        out = self._apply(block)
        if not len(out):
            raise ValueError(
                f"dataset {dataset!r}, file {file}, doc {doc}: the transforms {self.steps} drop "
                "this document now, but it was delivered before: the functions are not "
                "deterministic or the data changed since"
            )
        return out[0].data

    # -- internals -----------------------------------------------------------------------------
    def _fetch_source(self, dataset: str, file: int, doc: int) -> DocData:
        fetch = getattr(self.source, "fetch_document", None)
        if fetch is None:
            raise TypeError(
                f"the source {type(self.source).__name__} has no fetch_document; put the "
                "transform node on a ShardReader or Tokenize"
            )
        return fetch(dataset, file, doc)

    def _apply(self, block: DocumentBlock) -> DocumentBlock:
        """The steps applied to a block of whole documents; a user function's error re-raised
        with its file's URL added."""
        try:
            return self._apply_steps(block)
        except TransformError as err:
            name, cause = self._file_name(err.where), err.__cause__
            if err.where is None or not name or cause is None:
                raise
            raise TransformError.of(err.step, cause, err.where, name) from cause

    def _file_name(self, where: tuple[str, int, int] | None) -> str:
        """The URL of file number ``where[1]`` of dataset ``where[0]`` ("" if unknown)."""
        if where is None:
            return ""
        for node in graph_nodes(self.source):
            index = getattr(node, "dataset", None)
            if isinstance(index, DatasetIndex) and index.name == where[0]:
                return index.files[where[1]] if 0 <= where[1] < len(index.files) else ""
        return ""

    def _apply_steps(self, block: DocumentBlock) -> DocumentBlock:
        if not self._checked and len(block):
            self._checked = True
            for step in self.steps:
                first, again = step.apply(block), step.apply(block)
                if not _same(first, again):
                    raise ValueError(
                        f"transform {step.name!r} gave different results for the same block "
                        f"of dataset {block.dataset!r} (file {int(block.file[0])}): document "
                        "transforms must be deterministic (a function of the document alone), "
                        "as restores and rescales rebuild documents by applying them again"
                    )
                self._dropped(step, len(block), len(first))
                block = first
                self._check_ids(step, block)
            return block
        for step in self.steps:
            if not len(block):
                break
            n = len(block)
            block = step.apply(block)
            self._dropped(step, n, len(block))
            self._check_ids(step, block)
        return block

    def _check_ids(self, step: Transform, block: DocumentBlock) -> None:
        """Refuse a block whose tokens ``step`` (a map) left outside ``0..max_id``."""
        tokens = block.tokens
        if not step.changes_documents or tokens is None or not tokens.size:
            return
        top = self.max_id
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo >= 0 and (top is None or hi <= top):
            return
        bad = (tokens < 0) if top is None else (tokens < 0) | (tokens > top)
        at = int(np.flatnonzero(bad)[0])
        i = int(np.searchsorted(block.offsets, at, side="right")) - 1
        where = (block.dataset, int(block.file[i]), int(block.doc[i]))
        name = self._file_name(where)
        file = f"file {where[1]} ({name})" if name else f"file {where[1]}"
        allowed = "0 or more" if top is None else f"in 0..{top}"
        source = f" ({self.ids_from})" if self.ids_from else ""
        raise ValueError(
            f"transform {step.name!r} returned token id {int(tokens[at])} for dataset "
            f"{where[0]!r}, {file}, document {where[2]}: ids must be {allowed}{source}; make "
            "the transform return ids of the tokenizer's vocabulary"
        )

    def _dropped(self, step: Transform, before: int, after: int) -> None:
        if after < before:
            self._dropped_by[step.name] = self._dropped_by.get(step.name, 0) + before - after

    def _process(self, block: DocumentBlock) -> DocumentBlock | None:
        """One source block transformed (None: nothing of it is left)."""
        if block.stop is not None:  # handed back by a rescale
            if block.tokens is None:  # whole texts: tokenize cuts the pieces after encoding
                return self._apply(block)
            return self._handed_back(block)
        whole = (block.start == 0) & block.last
        if self._live_skip is None and whole.all():
            return self._apply(block)
        outs: list[DocumentBlock] = []
        i, n = 0, len(block)
        while i < n:
            if whole[i] and self._live_skip is None:
                j = i + 1
                while j < n and whole[j]:
                    j += 1
                outs.append(self._apply(block.select(i, j)))
                i = j
                continue
            key = [int(block.file[i]), int(block.doc[i])]
            if self._live_skip is not None:  # a piece of the cut document already emitted
                if key != self._live_skip:
                    raise ValueError(
                        f"dataset {block.dataset!r}: expected the rest of file "
                        f"{self._live_skip[0]} doc {self._live_skip[1]} but got a piece of file "
                        f"{key[0]} doc {key[1]}; the source's state does not match this node's"
                    )
                if block.last[i]:
                    self._live_skip = None
                i += 1
                continue
            if block.start[i] != 0:
                raise ValueError(
                    f"dataset {block.dataset!r}, file {key[0]}, doc {key[1]}: a piece from token "
                    f"{int(block.start[i])} arrived without the document's first piece; the "
                    "source must deliver cut documents from their start"
                )
            outs.append(self._cut_document(block, i))
            self._live_skip = key
            i += 1
        return _concat(outs, block) if outs else None

    def _cut_document(self, block: DocumentBlock, i: int) -> DocumentBlock:
        """The first piece ``i`` of a cut document: the whole document read again,
        transformed and cut into pieces of piece ``i``'s length (none if dropped)."""
        file, doc = int(block.file[i]), int(block.doc[i])
        data = self._fetch_source(block.dataset, file, doc)
        one = _one(block.dataset, file, doc, data)
        out = self._apply(one)
        if not len(out):
            return out
        tokens = out.tokens
        assert tokens is not None
        size = max(1, int(block.offsets[i + 1] - block.offsets[i]))
        starts = list(range(0, len(tokens), size)) or [0]
        pieces = [tokens[a : a + size] for a in starts]
        return DocumentBlock.from_pieces(
            block.dataset,
            pieces,
            [file] * len(pieces),
            [doc] * len(pieces),
            starts,
            [k == len(pieces) - 1 for k in range(len(pieces))],
            shard=block.shard,
            epoch=block.epoch,
            dtype=tokens.dtype,
        )

    def _handed_back(self, block: DocumentBlock) -> DocumentBlock:
        """Pieces a rescale handed back (``start .. stop`` of transformed documents): each
        document read again, transformed, and the piece cut out."""
        assert block.stop is not None and block.tokens is not None
        pieces, lasts, keep = [], [], np.ones(len(block), bool)
        for i, (a, stop) in enumerate(zip(block.start.tolist(), block.stop.tolist())):
            file, doc = int(block.file[i]), int(block.doc[i])
            if a == 0 and stop < 0:
                # a whole document a node below this one held (e.g. tokenize reading ahead):
                # it never went through the steps, which may drop it now
                raw = self._fetch_source(block.dataset, file, doc)
                one = _one(block.dataset, file, doc, raw)
                out = self._apply(one)
                if not len(out):
                    keep[i] = False
                    continue
                data = np.asarray(out[0].data)
            else:
                data = np.asarray(self.fetch_document(block.dataset, file, doc))
            piece, last = handed_back_piece(
                data,
                a,
                stop,
                f"dataset {block.dataset!r}, file {file}, doc {doc}",
                "the transformed document",
                "the transforms or the data",
            )
            pieces.append(piece)
            lasts.append(last)
        out = DocumentBlock.from_pieces(
            block.dataset,
            pieces,
            block.file[keep],
            block.doc[keep],
            block.start[keep],
            lasts,
            shard=block.shard,
            epoch=block.epoch,
            dtype=block.tokens.dtype,
        )
        out.stop = block.stop[keep]  # still handed back: Pack starts a continuation's row
        return out


def _one(dataset: str, file: int, doc: int, data: DocData) -> DocumentBlock:
    """A block of the one whole document ``data``."""
    dtype = np.int32 if isinstance(data, str) else np.asarray(data).dtype
    pieces: Any = [data]
    return DocumentBlock.from_pieces(dataset, pieces, [file], [doc], [0], [True], dtype=dtype)


class MapDocuments(TransformDocuments):
    """Change each document: a :class:`TransformDocuments` of one :class:`~torchdata_ext.
    transforms.Map`.

    Args:
        source: as :class:`TransformDocuments`.
        fn: ``fn(data, meta) -> new data | None`` per document (None drops it); ``data`` the
            tokens (read-only 1-D array) or, with ``on="text"``, the text.
        block_fn: the vectorised form, ``block_fn(block) -> (tokens, offsets)`` (text:
            ``-> list[str]``); give ``fn`` or ``block_fn``.
        on: ``"tokens"`` or ``"text"``.
        check_deterministic / max_dropped / max_id / ids_from: as :class:`TransformDocuments`.
    """

    def __init__(
        self,
        source: BaseNode[DocumentBlock],
        fn: Any = None,
        *,
        block_fn: Any = None,
        on: On = "tokens",
        check_deterministic: bool = True,
        max_dropped: int | None = DEFAULT_MAX_DROPPED,
        max_id: int | None = None,
        ids_from: str = "",
    ) -> None:
        step = Map(fn, block_fn=block_fn, on=on)
        super().__init__(
            source,
            [step],
            check_deterministic=check_deterministic,
            max_dropped=max_dropped,
            max_id=max_id,
            ids_from=ids_from,
        )


class FilterDocuments(TransformDocuments):
    """Keep or drop each document: a :class:`TransformDocuments` of one
    :class:`~torchdata_ext.transforms.Filter`.

    Args:
        source: as :class:`TransformDocuments`.
        fn: ``fn(data, meta) -> bool`` per document (True keeps it).
        block_fn: the vectorised form, ``block_fn(block) -> bool array`` (one per document);
            give ``fn`` or ``block_fn``.
        on: ``"tokens"`` or ``"text"``.
        check_deterministic / max_dropped: as :class:`TransformDocuments`.
    """

    def __init__(
        self,
        source: BaseNode[DocumentBlock],
        fn: Any = None,
        *,
        block_fn: Any = None,
        on: On = "tokens",
        check_deterministic: bool = True,
        max_dropped: int | None = DEFAULT_MAX_DROPPED,
    ) -> None:
        step = Filter(fn, block_fn=block_fn, on=on)
        super().__init__(
            source, [step], check_deterministic=check_deterministic, max_dropped=max_dropped
        )
