"""Tokenizers behind one batched interface: ``encode_batch(texts) -> list of int arrays``.

:class:`ByteTokenizer` is built in (UTF-8 bytes as ids, as in Bolmo's byte-level data prep).
:func:`as_encoder` adapts a Hugging Face ``tokenizers.Tokenizer``, a ``transformers`` tokenizer
(duck-typed: nothing here imports ``transformers``) or a :class:`ByteTokenizer` to the
:class:`Encoder` protocol the :class:`~torchdata_ext.nodes.tokenize.Tokenize` node calls.
:func:`load_tokenizer` turns a spec (``"byte"`` or the URL of a ``tokenizer.json``) into a
tokenizer, for the pipeline config and the ``prepare``/``inspect`` tools.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from torchdata_ext.urls import filesystem

__all__ = ["ByteTokenizer", "Encoder", "as_encoder", "load_tokenizer"]

_NUM_BYTES = 256


@runtime_checkable
class Encoder(Protocol):
    """Anything that turns a batch of texts into one 1-D integer array of token ids each."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text, in order."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids: the id of byte ``b`` is ``b + offset``.

    With the default ``offset=0`` ids are the raw bytes ``0..255`` and nothing is reserved.
    Pass ``offset=k`` to keep ids ``0..k-1`` free for special tokens, e.g.
    ``ByteTokenizer(offset=4, bos_token=1, eos_token=2)`` (ids 4..259 are bytes).

    Args:
        offset: added to every byte value; ``>= 0``.
        bos_token: the BOS id, or None. Informational: the tokenizer never adds it itself;
            pass it on, e.g. ``Tokenize(src, tok, bos_token=tok.bos_token)``. It must not be a
            byte id (``< offset`` or ``>= offset + 256``).
        eos_token: the EOS id, or None (same rules as ``bos_token``).

    Attributes:
        vocab_size: one more than the largest id it can produce or was given.
    """

    def __init__(
        self, offset: int = 0, *, bos_token: int | None = None, eos_token: int | None = None
    ) -> None:
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
            raise ValueError(f"{offset=} must be an integer >= 0")
        self.offset = int(offset)
        for name, tok in (("bos_token", bos_token), ("eos_token", eos_token)):
            if tok is None:
                continue
            if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)) or tok < 0:
                raise ValueError(f"{name}={tok!r} must be None or an integer >= 0")
            if self.offset <= tok < self.offset + _NUM_BYTES:
                raise ValueError(
                    f"{name}={tok} collides with the byte ids {self.offset}.."
                    f"{self.offset + _NUM_BYTES - 1}; raise offset above it (e.g. "
                    f"offset={int(tok) + 1}) or use an id >= {self.offset + _NUM_BYTES}"
                )
        self.bos_token = None if bos_token is None else int(bos_token)
        self.eos_token = None if eos_token is None else int(eos_token)
        specials = [t for t in (self.bos_token, self.eos_token) if t is not None]
        self.vocab_size = max([self.offset + _NUM_BYTES, *(t + 1 for t in specials)])

    def __repr__(self) -> str:
        return (
            f"ByteTokenizer(offset={self.offset}, bos_token={self.bos_token}, "
            f"eos_token={self.eos_token})"
        )

    def encode(self, text: str) -> np.ndarray:
        """The ids of one text (``int32``)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The ids of each text (``int32`` arrays), encoded in one NumPy pass."""
        raw = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw))
        ids = np.frombuffer(b"".join(raw), dtype=np.uint8).astype(np.int32)
        if self.offset:
            ids += self.offset
        return np.split(ids, np.cumsum(lengths)[:-1]) if raw else []

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of ``ids``; ids that are not bytes (special tokens) are dropped, and byte
        sequences that are not valid UTF-8 become U+FFFD."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        keep = arr[(arr >= self.offset) & (arr < self.offset + _NUM_BYTES)] - self.offset
        return keep.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _as_ids(x: Any) -> np.ndarray:
    """One document's ids as a 1-D integer array (``Encoding.ids`` lists are converted once)."""
    ids = getattr(x, "ids", x)
    arr = ids if isinstance(ids, np.ndarray) else np.array(ids, dtype=np.int64)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(
            f"the tokenizer returned {arr.dtype} ids of shape {arr.shape}; expected one "
            "1-D list or array of integer ids per text"
        )
    return arr if arr.dtype.kind in "iu" else arr.astype(np.int64)


class _BatchEncoder:
    """A tokenizer with ``encode_batch(texts)`` returning per-text ``Encoding`` objects (Hugging
    Face ``tokenizers.Tokenizer``; ``encode_batch_fast``, which skips offsets, when present) or
    per-text id arrays/lists."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        fast = getattr(self.tokenizer, "encode_batch_fast", None)
        out = (fast or self.tokenizer.encode_batch)(list(texts))
        return [_as_ids(e) for e in out]

    def __repr__(self) -> str:
        return f"as_encoder({self.tokenizer!r})"


class _CallableEncoder:
    """A ``transformers`` tokenizer: ``tokenizer(texts)["input_ids"]``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = self.tokenizer(list(texts))
        try:
            ids = out["input_ids"]
        except (KeyError, TypeError, IndexError) as exc:
            raise TypeError(
                f"calling the tokenizer {type(self.tokenizer).__name__} on a list of texts "
                "returned no 'input_ids'; pass a Hugging Face tokenizer, a transformers "
                "tokenizer or a ByteTokenizer"
            ) from exc
        return [_as_ids(e) for e in ids]

    def __repr__(self) -> str:
        return f"as_encoder({self.tokenizer!r})"


def as_encoder(tokenizer: Any) -> Encoder:
    """Adapt ``tokenizer`` to :class:`Encoder` (``encode_batch(texts) -> list[np.ndarray]``).

    Accepted, checked in this order:

    * a :class:`ByteTokenizer` (returned as is);
    * an object with ``encode_batch(texts)`` returning per-text objects with ``.ids`` (a Hugging
      Face ``tokenizers.Tokenizer``: special tokens of its post-processor are added, as
      ``tokenizer.encode(text).ids`` does) or per-text id lists/arrays;
    * a callable returning a mapping with ``"input_ids"`` (a ``transformers`` tokenizer).

    Raises:
        TypeError: ``tokenizer`` is none of these.
    """
    if isinstance(tokenizer, ByteTokenizer | _BatchEncoder | _CallableEncoder):
        return tokenizer
    if callable(getattr(tokenizer, "encode_batch", None)):
        return _BatchEncoder(tokenizer)
    if callable(tokenizer):
        return _CallableEncoder(tokenizer)
    raise TypeError(
        f"tokenizer={type(tokenizer).__name__} is not a tokenizer: pass a Hugging Face "
        "tokenizers.Tokenizer, a transformers tokenizer, or torchdata_ext.tokenizers.ByteTokenizer()"
    )


def load_tokenizer(spec: str, *, byte_offset: int) -> Any:
    """The tokenizer named by ``spec``.

    Args:
        spec: ``"byte"`` for :class:`ByteTokenizer`, else the path or fsspec URL of a Hugging
            Face ``tokenizer.json`` (needs the ``tokenizers`` package).
        byte_offset: the byte tokenizer's id offset (ignored for a ``tokenizer.json``). The
            pipeline passes 0 and ``prepare``/``inspect`` their ``byte_offset`` (default 1).

    Returns:
        A :class:`ByteTokenizer` or a ``tokenizers.Tokenizer`` (wrap it with :func:`as_encoder`
        for ``encode_batch``; its ``decode`` is its own).

    Raises:
        ImportError: ``tokenizers`` is not installed.
        FileNotFoundError: no file at ``spec``.
        ValueError: the file is not a ``tokenizer.json``.
    """
    if spec == "byte":
        return ByteTokenizer(offset=byte_offset)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(
            "text data needs the tokenizers package: pip install 'torchdata-ext[text]'"
        ) from None
    fs, path = filesystem(spec)
    if not fs.exists(path):
        raise FileNotFoundError(
            f"tokenizer={spec!r}: no such file; pass 'byte' or the path of a tokenizer.json"
        )
    if fs.isdir(path):
        raise ValueError(
            f"tokenizer={spec!r} is a folder; pass the tokenizer.json inside it (or 'byte')"
        )
    with fs.open(path, "rb") as f:
        raw = f.read()
    try:
        return Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # tokenizers raises a bare Exception("expected ident at line 1 ...")
        raise ValueError(
            f"tokenizer={spec!r} is not a Hugging Face tokenizer.json ({exc}); pass 'byte' or "
            "the path of a tokenizer.json (as tokenizers.Tokenizer.save writes it)"
        ) from None
