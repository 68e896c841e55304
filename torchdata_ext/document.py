"""What flows between nodes: blocks of documents with their provenance.

Documents travel in :class:`DocumentBlock` s, many documents per block as one concatenated
token array plus offsets, so per-document Python work stays off the hot path. Each document
(or piece of a long document) keeps where it came from: dataset, file number, document
number in the file, and the token offset of the piece inside the document, so any piece can be
read again from the source.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["Document", "DocumentBlock", "handed_back_piece"]


class Document(NamedTuple):
    """One document, or one piece of a long document.

    Attributes:
        data: token ids (1-D integer array) or text (``str``).
        dataset: the dataset name.
        file: the file's number in the dataset's sorted file list (``DatasetIndex.files``).
        doc: the document's number inside that file.
        start: offset (tokens, or characters for text) of this piece inside the document after
            ``strip_tokens``; 0 for a whole document.
        last: whether this piece ends the document.
        epoch: the epoch of the logical shard the document was read in.
    """

    data: np.ndarray | str
    dataset: str
    file: int
    doc: int
    start: int = 0
    last: bool = True
    epoch: int = 0


@dataclass
class DocumentBlock:
    """Several documents (or pieces) of one dataset, stored together.

    Attributes:
        dataset: the dataset name.
        tokens: all token pieces concatenated (1-D integer array), or None for text.
        texts: the text pieces, or None for tokens.
        offsets: ``int64`` array of length ``n + 1``; piece ``i`` is
            ``tokens[offsets[i]:offsets[i + 1]]`` (for text, offsets count characters).
        file: ``int32`` file number of each piece.
        doc: ``int64`` document number (inside its file) of each piece.
        start: ``int64`` offset of each piece inside its document.
        last: ``bool`` whether each piece ends its document.
        shard: the logical shard the block was read from (-1 if mixed).
        epoch: the epoch of that shard (-1 if mixed).
        stop: None unless a rescale handed back the pieces: ``int64`` per piece. Text
            blocks: -1 for a whole text, else the piece is the tokens ``start .. stop`` of the
            text once tokenized (the tokenize node cuts it; ``last`` is decided there). Token
            blocks: the ``stop`` that was handed back (the piece is already cut from the
            document as read); a transform node, in whose coordinates ``start .. stop`` are,
            cuts it again from the transformed document. A tokenize node with
            ``cut_handed_back=False`` hands whole documents on with ``stop`` kept.
    """

    dataset: str
    tokens: np.ndarray | None
    texts: list[str] | None
    offsets: np.ndarray
    file: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    last: np.ndarray
    shard: int = -1
    epoch: int = -1
    stop: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Length of each piece (tokens, or characters for text)."""
        off = self.offsets
        return off[1:] - off[:-1]

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> Document:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"piece {i} out of range for a block of {n}")
        if self.tokens is not None:
            data: np.ndarray | str = self.tokens[self.offsets[i] : self.offsets[i + 1]]
        else:
            assert self.texts is not None
            data = self.texts[i]
        return Document(
            data,
            self.dataset,
            int(self.file[i]),
            int(self.doc[i]),
            int(self.start[i]),
            bool(self.last[i]),
            self.epoch,
        )

    def __iter__(self) -> Iterator[Document]:
        for i in range(len(self)):
            yield self[i]

    def select(self, lo: int, hi: int) -> DocumentBlock:
        """Pieces ``lo .. hi`` as a new block sharing this block's memory (zero-copy)."""
        n = len(self)
        lo, hi = max(0, min(lo, n)), max(0, min(hi, n))
        hi = max(lo, hi)
        off = self.offsets[lo : hi + 1]
        base = int(off[0]) if len(off) else 0
        return DocumentBlock(
            self.dataset,
            None if self.tokens is None else self.tokens[base : int(off[-1])],
            None if self.texts is None else self.texts[lo:hi],
            off - base,
            self.file[lo:hi],
            self.doc[lo:hi],
            self.start[lo:hi],
            self.last[lo:hi],
            self.shard,
            self.epoch,
            None if self.stop is None else self.stop[lo:hi],
        )

    def pieces(self) -> list[tuple[str, int, int, int, int]]:
        """Provenance of every piece: ``(dataset, file, doc, start, stop)`` (stop -1 for text
        pieces that run to the end of their document; pieces handed back by a rescale keep
        the ``stop`` they were handed back with)."""
        ends = self.stop
        if ends is None and self.tokens is not None:
            ends = self.start + self.lengths
        out = []
        for i in range(len(self)):
            stop = -1 if ends is None else int(ends[i])
            out.append(
                (self.dataset, int(self.file[i]), int(self.doc[i]), int(self.start[i]), stop)
            )
        return out

    @classmethod
    def from_pieces(
        cls,
        dataset: str,
        pieces: Sequence[np.ndarray] | Sequence[str],
        file: Sequence[int] | np.ndarray,
        doc: Sequence[int] | np.ndarray,
        start: Sequence[int] | np.ndarray,
        last: Sequence[bool] | np.ndarray,
        *,
        shard: int = -1,
        epoch: int = -1,
        dtype: np.dtype | type = np.int32,
    ) -> DocumentBlock:
        """Build a block from per-piece arrays (or strings) and provenance."""
        n = len(pieces)
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=n)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens: np.ndarray | None
        texts: list[str] | None
        if n and isinstance(pieces[0], str):
            tokens, texts = None, list(pieces)  # type: ignore[arg-type]
        else:
            tokens = (
                np.concatenate(pieces, dtype=dtype, casting="unsafe") if n else np.zeros(0, dtype)
            )
            texts = None
        return cls(
            dataset,
            tokens,
            texts,
            offsets,
            np.asarray(file, np.int32),
            np.asarray(doc, np.int64),
            np.asarray(start, np.int64),
            np.asarray(last, bool),
            shard,
            epoch,
        )


def handed_back_piece(
    doc: np.ndarray, start: int, stop: int, where: str, of_what: str, changed: str
) -> tuple[np.ndarray, bool]:
    """Tokens ``start .. stop`` (``stop`` -1: to the end) of the whole document ``doc``, as a
    rescale handed them back, and whether the piece ends the document.

    Args:
        where: the document, for the error (``"dataset 'web', file 3, doc 7"``).
        of_what: what ``doc`` is, for the error (``"its text"``).
        changed: what may have changed since the checkpoint, for the error.

    Raises:
        ValueError: the piece is not inside ``doc`` (what was handed back no longer matches).
    """
    b = len(doc) if stop < 0 else stop
    if not 0 <= start <= b <= len(doc):
        raise ValueError(
            f"{where}: the piece {start}..{b} handed back by a rescale is not inside the "
            f"{len(doc)} tokens of {of_what}: {changed} changed since the checkpoint"
        )
    return doc[start:b], b == len(doc)
