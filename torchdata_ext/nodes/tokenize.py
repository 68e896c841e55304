"""The tokenize node: text blocks in, token blocks out, on a thread pool, in order.

Each text block is encoded with one ``encode_batch`` call on its texts, then BOS/EOS are
ensured per document with NumPy on the whole block. Encoding runs on a
``concurrent.futures.ThreadPoolExecutor`` (Hugging Face tokenizers release the GIL) with up to
``prefetch`` blocks in flight; blocks come out in the order they were read, so resuming is exact.

State: ``{"source": <the source's state right after it delivered the last block this node
emitted>}``. Blocks in flight are not part of the state: on restore the source is reset to that
state and they are read and encoded again. Resume guarantee: restoring a state continues with
exactly the blocks the uninterrupted run would have produced next.
"""

from __future__ import annotations

import collections
import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.document import DocumentBlock, handed_back_piece
from torchdata_ext.handlers.base import DocData
from torchdata_ext.state.settings import SETTINGS_KEY, check_settings
from torchdata_ext.tokenizers.load import Encoder, as_encoder, tokenizer_identity

__all__ = ["Tokenize", "ensure_bos_eos"]


def ensure_bos_eos(
    tokens: np.ndarray,
    offsets: np.ndarray,
    bos_token: int | None,
    eos_token: int | None,
    dtype: np.dtype | type = np.int32,
) -> tuple[np.ndarray, np.ndarray]:
    """Add BOS/EOS to each document of a concatenated token array where they are missing.

    Document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``. BOS is put in front of a document
    unless it already starts with BOS, EOS at its end unless it already ends with EOS (an empty
    document gets both). When ``bos_token == eos_token`` one such token at either end is enough:
    a document that starts or ends with it is left alone, any other gets it appended (as EOS),
    so concatenated documents never show the token twice in a row (epochraft's rule).

    Returns:
        ``(tokens, offsets)`` of the result, ``tokens`` in ``dtype``.
    """
    n = len(offsets) - 1
    lengths = np.diff(offsets)
    nonempty = lengths > 0
    if tokens.size:
        first = tokens[np.minimum(offsets[:-1], tokens.size - 1)]
        last = tokens[np.maximum(offsets[1:] - 1, 0)]
    else:
        first = last = np.zeros(n, np.int64)
    no = np.zeros(n, bool)
    if bos_token is not None and bos_token == eos_token:
        add_bos = no
        add_eos = ~(nonempty & ((first == eos_token) | (last == eos_token)))
    else:
        add_bos = no if bos_token is None else ~nonempty | (first != bos_token)
        add_eos = no if eos_token is None else ~nonempty | (last != eos_token)
    if not (add_bos.any() or add_eos.any()):
        return tokens.astype(dtype, copy=False), offsets
    new_offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths + add_bos + add_eos, out=new_offsets[1:])
    out = np.empty(int(new_offsets[-1]), dtype)
    keep = np.ones(out.size, bool)
    if bos_token is not None:
        where = new_offsets[:-1][add_bos]
        out[where] = bos_token
        keep[where] = False
    if eos_token is not None:
        where = new_offsets[1:][add_eos] - 1
        out[where] = eos_token
        keep[where] = False
    out[keep] = tokens
    return out, new_offsets


def _encode_block(
    encoder: Encoder,
    block: DocumentBlock,
    bos_token: int | None,
    eos_token: int | None,
    dtype: np.dtype,
    cut: bool = True,
    skip: int = 0,
) -> DocumentBlock:
    """The token block of a text block (runs on a pool thread; touches no node state). The
    first ``skip`` texts are not encoded: they are left empty (see :meth:`Tokenize.skip_next`)."""
    assert block.texts is not None
    skip = min(skip, len(block.texts)) if block.stop is None else 0
    arrays = encoder.encode_batch(block.texts[skip:])
    if len(arrays) != len(block.texts) - skip:
        raise ValueError(
            f"the tokenizer returned {len(arrays)} encodings for {len(block.texts) - skip} texts"
        )
    n = len(arrays)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.fromiter(map(len, arrays), np.int64, count=n), out=offsets[1:])
    flat = np.concatenate(arrays) if n else np.zeros(0, np.int64)
    if flat.size:
        info = np.iinfo(dtype)
        lo, hi = int(flat.min()), int(flat.max())
        if lo < info.min or hi > info.max:
            raise ValueError(
                f"token ids {lo}..{hi} of dataset {block.dataset!r} do not fit {dtype=}; "
                "pass a wider dtype to Tokenize (e.g. np.int64)"
            )
    tokens, offsets = ensure_bos_eos(flat, offsets, bos_token, eos_token, dtype)
    if skip:  # the pieces not encoded come first, empty
        offsets = np.concatenate([np.zeros(skip, np.int64), offsets])
    if block.stop is not None and cut:
        return _cut_handed_back(block, tokens, offsets)
    return DocumentBlock(
        block.dataset,
        tokens,
        None,
        offsets,
        block.file,
        block.doc,
        block.start,
        block.last if block.stop is None else np.ones(len(block), bool),
        block.shard,
        block.epoch,
        block.stop,
    )


def _cut_handed_back(
    block: DocumentBlock, tokens: np.ndarray, offsets: np.ndarray
) -> DocumentBlock:
    """Cut the token pieces ``start .. stop`` that a rescale handed back out of their encoded
    texts (``stop`` -1: to the end)."""
    assert block.stop is not None
    pieces, lasts = [], []
    for i, (a, stop) in enumerate(zip(block.start.tolist(), block.stop.tolist())):
        piece, last = handed_back_piece(
            tokens[offsets[i] : offsets[i + 1]],
            a,
            stop,
            f"dataset {block.dataset!r}, file {int(block.file[i])}, doc {int(block.doc[i])}",
            "its text",
            "the tokenizer, BOS/EOS settings or the data",
        )
        pieces.append(piece)
        lasts.append(last)
    out = DocumentBlock.from_pieces(
        block.dataset,
        pieces,
        block.file,
        block.doc,
        block.start,
        lasts,
        shard=block.shard,
        epoch=block.epoch,
        dtype=tokens.dtype,
    )
    out.stop = block.stop  # still handed back: Pack starts a continuation's row
    return out


class Tokenize(BaseNode[DocumentBlock]):
    """Tokenize text blocks (token blocks pass through unchanged), keeping their provenance.

    Args:
        source: a node of :class:`~torchdata_ext.document.DocumentBlock` s, e.g. a
            :class:`~torchdata_ext.nodes.reader.ShardReader` over text. Text must reach this
            node whole: documents are cut (into ``seq_len`` pieces) after tokenizing, by the
            packer, so do not set ``max_chunksize`` on a text reader.
        tokenizer: a Hugging Face ``tokenizers.Tokenizer``, a ``transformers`` tokenizer or a
            :class:`~torchdata_ext.tokenizers.load.ByteTokenizer` (see
            :func:`~torchdata_ext.tokenizers.load.as_encoder`). Its own special tokens (post-processor)
            are kept.
        bos_token: put in front of each document that does not start with it; None: never.
        eos_token: put at the end of each document that does not end with it; None: never. If
            equal to ``bos_token``, a document with it at either end gets nothing, any other gets
            one at its end (see :func:`ensure_bos_eos`).
        num_threads: encoding threads; 0 encodes in the calling thread (no pool, no prefetch).
        prefetch: at most this many blocks are read and being encoded ahead (>= 1).
        dtype: integer dtype of the output tokens.
        cut_handed_back: cut the token pieces a rescale handed back out of their encoded texts
            (default). False hands the whole encoded documents on with ``stop`` kept, for a
            :class:`~torchdata_ext.nodes.transform.TransformDocuments` after this node, whose
            coordinates the pieces are in (it cuts them).
    """

    SOURCE_KEY = "source"

    def __init__(
        self,
        source: BaseNode[DocumentBlock],
        tokenizer: Any,
        *,
        bos_token: int | None = None,
        eos_token: int | None = None,
        num_threads: int = 2,
        prefetch: int = 2,
        dtype: np.dtype | type = np.int32,
        cut_handed_back: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(source, BaseNode):
            raise TypeError(f"source must be a torchdata.nodes.BaseNode, got {type(source)!r}")
        self.cut_handed_back = bool(cut_handed_back)
        self.dtype = np.dtype(dtype)
        if self.dtype.kind not in "iu":
            raise TypeError(f"{dtype=} must be an integer dtype such as np.int32 or np.int64")
        info = np.iinfo(self.dtype)
        for name, tok in (("bos_token", bos_token), ("eos_token", eos_token)):
            if tok is None:
                continue
            if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
                raise TypeError(f"{name}={tok!r} must be None or an int token id")
            if not max(0, info.min) <= tok <= info.max:
                raise ValueError(f"{name}={tok} must be >= 0 and fit {dtype=}")
        for name, value, low in (("num_threads", num_threads, 0), ("prefetch", prefetch, 1)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}={value!r} must be an int")
            if value < low:
                raise ValueError(f"{name}={value} must be >= {low}")
        self.source = source
        self.encoder = as_encoder(tokenizer)
        self._settings: dict[str, Any] | None = None  # tokenizer_identity, found when first needed
        self.bos_token = None if bos_token is None else int(bos_token)
        self.eos_token = None if eos_token is None else int(eos_token)
        self.num_threads = num_threads
        self.prefetch = prefetch
        self._executor: ThreadPoolExecutor | None = None
        # blocks read ahead, oldest first: (encoded block or its future, source state after it)
        self._pending: collections.deque[tuple[Future[DocumentBlock] | DocumentBlock, Any]] = (
            collections.deque()
        )
        self._source_state: Any = None
        self._exhausted = False
        self._replay = False
        self._skip = 0  # pieces of the next block not to encode (see skip_next)

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._drop_pending()
        self._exhausted = False
        self._replay = False
        if initial_state is not None:
            check_settings("Tokenize", initial_state, self.settings)
            self.source.reset(initial_state[self.SOURCE_KEY])
        else:
            self.source.reset()
        self._source_state = self.source.state_dict()
        self._skip = 0

    @property
    def settings(self) -> dict[str, Any]:
        """The tokenizer this node's positions are counted in (``tokenizer``: ``"byte"`` with
        its ``byte_offset``, or the hash of a Hugging Face tokenizer; see
        :func:`~torchdata_ext.tokenizers.load.tokenizer_identity`), recorded in the state so a
        restore with another tokenizer is refused by name. Never mutated."""
        if self._settings is None:
            self._settings = tokenizer_identity(self.encoder)
        return self._settings

    def skip_next(self, pieces: int) -> None:
        """Called by the node above right after a restore (``Interleave``): it will drop the
        first ``pieces`` pieces of the next block, delivered before the checkpoint, so they
        are not encoded again (they come out empty); and it will ask for that block at once,
        so its encoding (and the read-ahead's) starts now, side by side with the other
        datasets'."""
        self._skip = max(0, int(pieces))
        if self.num_threads:
            self._fill()

    def next(self) -> DocumentBlock:
        if self._replay:  # unpickled with blocks in flight: read them again
            self.source.reset(self._source_state)
            self._replay = self._exhausted = False
        if self.num_threads == 0:
            skip, self._skip = self._skip, 0
            out = self._encode_now(next(self.source), skip)
            self._source_state = self.source.state_dict()  # only once the block is encoded
            return out
        self._fill()
        if not self._pending:
            raise StopIteration
        item, state = self._pending.popleft()
        block = item.result() if isinstance(item, Future) else item
        self._source_state = state
        return block

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self._source_state, SETTINGS_KEY: self.settings}

    # -- provenance ----------------------------------------------------------------------------
    def inflight(self) -> list[tuple[str, int, int, int, int]]:
        """Pieces read from the source but not yet emitted (blocks encoding ahead), as
        ``(dataset, file, doc, start, stop)``; used to hand them on when rescaling."""
        out: list[tuple[str, int, int, int, int]] = []
        for item, _ in self._pending:
            block = item.result() if isinstance(item, Future) else item
            pieces = block.pieces()
            if block.stop is None:  # whole documents go back as such (stop -1): a transform
                # node after this one may change their length
                whole = ((block.start == 0) & block.last).tolist()
                pieces = [(d, f, k, a, -1 if w else b) for (d, f, k, a, b), w in zip(pieces, whole)]
            out.extend(pieces)
        return out

    def fetch_document(self, dataset: str, file: int, doc: int) -> DocData:
        """Document ``doc`` of file number ``file`` of ``dataset`` as this node delivers it:
        read again from the source and, if it is text, tokenized with the same tokenizer and
        BOS/EOS rule."""
        fetch = getattr(self.source, "fetch_document", None)
        if fetch is None:
            raise TypeError(
                f"the source {type(self.source).__name__} has no fetch_document; "
                "put Tokenize on a ShardReader (or another node that can fetch documents)"
            )
        data = fetch(dataset, file, doc)
        if not isinstance(data, str):
            return data
        block = DocumentBlock.from_pieces(dataset, [data], [file], [doc], [0], [True])
        out = self._encode_now(block).tokens
        assert out is not None
        return out

    # -- threads -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the encoding threads and drop blocks in flight (the node can be reset and used
        again; threads are started again when needed)."""
        self._drop_pending()
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def __del__(self) -> None:
        executor = getattr(self, "_executor", None)
        if executor is not None:
            with contextlib.suppress(Exception):  # e.g. at interpreter shutdown
                executor.shutdown(wait=False, cancel_futures=True)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_executor"] = None
        state["_pending"] = collections.deque()
        state["_replay"] = bool(self._pending) or self._replay
        return state

    # -- internals -----------------------------------------------------------------------------
    def _encode_now(self, block: DocumentBlock, skip: int = 0) -> DocumentBlock:
        if block.texts is None:
            return block
        self._check_whole(block)
        return self._encode(block, skip)

    def _encode(self, block: DocumentBlock, skip: int) -> DocumentBlock:
        """:func:`_encode_block` with this node's settings (also on a pool thread: it reads
        only settings fixed at construction)."""
        return _encode_block(
            self.encoder,
            block,
            self.bos_token,
            self.eos_token,
            self.dtype,
            self.cut_handed_back,
            skip,
        )

    def _fill(self) -> None:
        while not self._exhausted and len(self._pending) < self.prefetch:
            try:
                block = next(self.source)
            except StopIteration:
                self._exhausted = True
                break
            state = self.source.state_dict()
            skip, self._skip = self._skip, 0  # the first block after skip_next only
            if block.texts is None:
                self._pending.append((block, state))
                continue
            self._check_whole(block)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.num_threads, thread_name_prefix="torchdata_ext-tokenize"
                )
            self._pending.append((self._executor.submit(self._encode, block, skip), state))

    def _drop_pending(self) -> None:
        for item, _ in self._pending:
            if isinstance(item, Future):
                item.cancel()
        self._pending.clear()

    @staticmethod
    def _check_whole(block: DocumentBlock) -> None:
        if block.stop is not None:  # token pieces handed back by a rescale: cut after encoding
            return
        if len(block) and (block.start.any() or not block.last.all()):
            i = int(np.flatnonzero((block.start != 0) | ~block.last)[0])
            raise ValueError(
                f"dataset {block.dataset!r}: text piece {i} (file {int(block.file[i])}, doc "
                f"{int(block.doc[i])}, start {int(block.start[i])}) is part of a document; text "
                "must reach Tokenize whole: do not set max_chunksize on a text reader (documents "
                "are cut into sequences after tokenizing, by the packer)"
            )
