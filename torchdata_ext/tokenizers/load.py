"""Tokenizers behind one batched interface: ``encode_batch(texts) -> list of int arrays``.

:class:`ByteTokenizer` is built in (UTF-8 bytes as ids, as in Bolmo's byte-level data prep).
:func:`as_encoder` adapts a Hugging Face ``tokenizers.Tokenizer``, a ``transformers`` tokenizer
(duck-typed: nothing here imports ``transformers``) or a :class:`ByteTokenizer` to the
:class:`Encoder` protocol the :class:`~torchdata_ext.nodes.tokenize.Tokenize` node calls.
:func:`load_tokenizer` turns a spec (``"byte"`` or the URL of a ``tokenizer.json``) into a
tokenizer, for the pipeline config and the ``prepare``/``inspect`` tools.

**One byte tokenizer.** ``"byte"`` means the same everywhere (config, ``prepare``, ``inspect``,
the CLI): byte ``b`` is id ``b + byte_offset``, with ``byte_offset`` :data:`DEFAULT_BYTE_OFFSET`
(1) unless given, so id 0 (the default EOS and pad) is never a byte.

**Special ids that cannot collide.** :func:`token_ids` says which ids a tokenizer emits for
ordinary text (:class:`TokenIds`); :func:`check_special_tokens` refuses a BOS/EOS/pad id that is
one of them, or that the output dtype cannot hold, naming the allowed ids.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from torchdata_ext.remote.urls import filesystem

__all__ = [
    "DEFAULT_BYTE_OFFSET",
    "ByteTokenizer",
    "Encoder",
    "TokenIds",
    "as_encoder",
    "check_special_tokens",
    "limit_tokenizer_threads",
    "load_tokenizer",
    "token_ids",
    "tokenizer_hash",
    "tokenizer_identity",
    "tokenizer_location",
    "worker_threads",
]

_NUM_BYTES = 256
DEFAULT_BYTE_OFFSET = 1
"""The byte tokenizer's id offset unless one is given: byte ``b`` is id ``b + 1``, so id 0
(the default EOS and pad token) is never a byte."""


def _cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def worker_threads(num_workers: int, cores: int | None = None) -> int:
    """Encoding threads for each of ``num_workers`` processes (0: loading in the training
    process, as 1) sharing ``cores`` (default: the cores available): ``cores // num_workers``,
    at least 1, so the workers' tokenizers together use the cores without oversubscribing them.
    """
    if cores is None:
        cores = _cores()
    return max(1, cores // max(1, num_workers))


def limit_tokenizer_threads(num_workers: int, cores: int | None = None) -> int | None:
    """In a dataloader worker process, before a tokenizer runs: give Hugging Face
    ``tokenizers`` (its Rayon thread pool) :func:`worker_threads` threads by setting
    ``RAYON_NUM_THREADS`` (and ``TOKENIZERS_PARALLELISM=false`` for one thread), unless the user
    set either variable. Returns the threads set, or None when the user's setting stands.

    Without it every worker's tokenizer starts a thread per core, and 2 workers on 2 cores
    tokenize slower than one process (``docs/time-to-data.md``)."""
    if "RAYON_NUM_THREADS" in os.environ or "TOKENIZERS_PARALLELISM" in os.environ:
        return None
    threads = worker_threads(num_workers, cores)
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    if threads == 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return threads


@runtime_checkable
class Encoder(Protocol):
    """Anything that turns a batch of texts into one 1-D integer array of token ids each."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text, in order."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids: the id of byte ``b`` is ``b + offset``.

    With the default ``offset=1`` (:data:`DEFAULT_BYTE_OFFSET`, what ``"byte"`` means in the
    config, ``prepare`` and ``inspect``) ids 1..256 are bytes and id 0 is free for EOS/padding.
    ``offset=0`` gives the raw bytes ``0..255`` with nothing reserved. Pass ``offset=k`` to keep
    ids ``0..k-1`` free for special tokens, e.g.
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
        self,
        offset: int = DEFAULT_BYTE_OFFSET,
        *,
        bos_token: int | None = None,
        eos_token: int | None = None,
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
        """The ids of each text (``int32`` arrays, ``int64`` when an id passes ``int32``),
        encoded in one NumPy pass."""
        raw = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw))
        wide = self.offset + _NUM_BYTES > 2**31  # ids past int32 (offsets up to uint32)
        ids = np.frombuffer(b"".join(raw), dtype=np.uint8).astype(np.int64 if wide else np.int32)
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
    per-text id arrays/lists.

    The text of a special token inside a document (``"<|endoftext|>"`` written in it) is
    ordinary text: a Hugging Face tokenizer encodes through a copy with
    ``encode_special_tokens = True`` (the given one is left as it is), so only the tokenizer's
    post-processor and the pipeline's ``bos_token``/``eos_token`` put special ids in a document.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._literal: Any = None  # the copy that encodes special-token text as text

    def _encoding(self) -> Any:
        tok = self._literal
        if tok is None:  # built when first used: the flag is not pickled (nor in to_str)
            tok = self.tokenizer
            if hasattr(tok, "encode_special_tokens") and callable(getattr(tok, "to_str", None)):
                tok = type(tok).from_str(tok.to_str())
                tok.encode_special_tokens = True
            self._literal = tok
        return tok

    def __getstate__(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer, "_literal": None}

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        tok = self._encoding()
        fast = getattr(tok, "encode_batch_fast", None)
        out = (fast or tok.encode_batch)(list(texts))
        return [_as_ids(e) for e in out]

    def __repr__(self) -> str:
        return f"as_encoder({self.tokenizer!r})"


class _CallableEncoder:
    """A ``transformers`` tokenizer: ``tokenizer(texts)["input_ids"]``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        try:  # special-token text in a document is text (see _BatchEncoder)
            out = self.tokenizer(list(texts), split_special_tokens=True)
        except TypeError:  # a callable without the keyword
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
    * a callable returning a mapping with ``"input_ids"`` (a ``transformers`` tokenizer, called
      with ``split_special_tokens=True``).

    The literal text of a special token inside a document (``"<|endoftext|>"``) is encoded as
    ordinary text, never as the special id, on the fly and in ``prepare`` alike.

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
        "tokenizers.Tokenizer, a transformers tokenizer, or torchdata_ext.tokenizers.load.ByteTokenizer()"
    )


def tokenizer_location(spec: str) -> str:
    """``spec`` as it finds the same tokenizer from any folder: a local file as an absolute
    path (what ``prepare`` records, so ``inspect`` run elsewhere decodes); ``"byte"``, URLs
    and model names as given."""
    if spec == "byte" or "://" in spec or not os.path.exists(spec):
        return spec
    return os.path.abspath(spec)


def load_tokenizer(
    spec: str,
    *,
    byte_offset: int = DEFAULT_BYTE_OFFSET,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """The tokenizer named by ``spec``.

    Args:
        spec: ``"byte"`` for :class:`ByteTokenizer`, else the path or fsspec URL of a Hugging
            Face ``tokenizer.json`` (needs the ``tokenizers`` package), or a model name already
            in the local Hugging Face cache (:mod:`torchdata_ext.tokenizers.names`).
        byte_offset: the byte tokenizer's id offset (ignored for a ``tokenizer.json``); the
            config, ``prepare`` and ``inspect`` all pass theirs, default
            :data:`DEFAULT_BYTE_OFFSET`.
        storage_options: fsspec options of a ``tokenizer.json`` URL (the call's options: the
            config's ``storage_options``, ``prepare``'s and ``inspect``'s ``--storage-options``).

    Returns:
        A :class:`ByteTokenizer` or a ``tokenizers.Tokenizer`` (wrap it with :func:`as_encoder`
        for ``encode_batch``; its ``decode`` is its own).

    Raises:
        ImportError: ``tokenizers`` is not installed.
        FileNotFoundError: no file at ``spec`` (nor a cached model of that name).
        ValueError: the file is not a ``tokenizer.json``; ``spec`` is ``"byte"`` in other
            letter case or with spaces (the name is ``"byte"``).
    """
    if spec == "byte":
        return ByteTokenizer(offset=byte_offset)
    if isinstance(spec, str) and spec.strip().lower() == "byte":
        raise ValueError(f"tokenizer={spec!r}: the byte tokenizer is named 'byte' (lower case)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(
            "text data needs the tokenizers package: pip install 'torchdata-ext[text]'"
        ) from None
    fs, path = filesystem(spec, storage_options)
    if not fs.exists(path):
        from torchdata_ext.tokenizers.names import is_model_name, load_cached_tokenizer

        if is_model_name(spec):  # "owner/name": from the local Hugging Face cache, no download
            return load_cached_tokenizer(spec)
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


# -- which ids a tokenizer emits ---------------------------------------------------------------
@dataclass(frozen=True)
class TokenIds:
    """Which ids a tokenizer emits for ordinary text, and which are its own special tokens.

    Attributes:
        name: the tokenizer, for messages (``"'byte' (byte_offset=1)"``, a file name).
        ordinary: the ids ordinary text can produce, as sorted half-open ``(lo, hi)`` ranges.
        specials: the tokenizer's own special-token ids (allowed as BOS/EOS/pad).
        vocab_size: one more than the largest id the tokenizer knows.
        byte_offset: the byte tokenizer's offset, or None for another tokenizer.
    """

    name: str
    ordinary: tuple[tuple[int, int], ...]
    specials: tuple[int, ...] = ()
    vocab_size: int = 0
    byte_offset: int | None = None

    def is_ordinary(self, token: int) -> bool:
        """Whether ordinary text can produce ``token``."""
        return token not in self.specials and any(lo <= token < hi for lo, hi in self.ordinary)

    def what(self, token: int) -> str:
        """What ``token`` is to this tokenizer, for messages (``"byte 0x40 '@'"``)."""
        if self.byte_offset is not None:
            b = token - self.byte_offset
            shown = f" {chr(b)!r}" if 0x20 <= b < 0x7F else ""
            return f"byte 0x{b:02X}{shown}"
        return "a token of its vocabulary"


def _ranges(ids: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Sorted unique ``ids`` as half-open ``(lo, hi)`` runs of consecutive ids."""
    ids = np.unique(np.asarray(ids, dtype=np.int64))
    if not ids.size:
        return ()
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], cuts])
    stops = np.concatenate([cuts, [ids.size]])
    return tuple((int(ids[a]), int(ids[b - 1]) + 1) for a, b in zip(starts, stops))


def token_ids(tokenizer: Any, spec: str | None = None) -> TokenIds:
    """Which ids ``tokenizer`` emits for ordinary text (see :class:`TokenIds`).

    Args:
        tokenizer: a :class:`ByteTokenizer` or a Hugging Face ``tokenizers.Tokenizer`` (for it,
            the ordinary ids are its vocabulary less its special added tokens, whose ids are
            :attr:`TokenIds.specials`).
        spec: what the tokenizer was loaded from, for messages (default: its type).

    Raises:
        TypeError: ``tokenizer`` is neither.
    """
    if isinstance(tokenizer, ByteTokenizer):
        off = tokenizer.offset
        return TokenIds(
            name=f"{spec or 'byte'!r} (byte_offset={off})",
            ordinary=((off, off + _NUM_BYTES),),
            specials=(),
            vocab_size=off + _NUM_BYTES,
            byte_offset=off,
        )
    get_vocab = getattr(tokenizer, "get_vocab", None)
    added = getattr(tokenizer, "get_added_tokens_decoder", None)
    if not (callable(get_vocab) and callable(added)):
        raise TypeError(
            f"tokenizer={type(tokenizer).__name__}: cannot tell which ids it emits; pass a "
            "ByteTokenizer or a Hugging Face tokenizers.Tokenizer"
        )
    vocab = np.fromiter(get_vocab(with_added_tokens=True).values(), dtype=np.int64)
    specials = sorted(int(i) for i, t in added().items() if getattr(t, "special", False))
    ordinary = np.setdiff1d(vocab, np.array(specials, dtype=np.int64))
    size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    return TokenIds(
        name=repr(spec) if spec else type(tokenizer).__name__,
        ordinary=_ranges(ordinary),
        specials=tuple(specials),
        vocab_size=max(size, int(vocab.max()) + 1 if vocab.size else 0),
    )


def tokenizer_hash(tokenizer: Any) -> str | None:
    """A short hash of a Hugging Face tokenizer's JSON (None for a :class:`ByteTokenizer`,
    which its offset describes): two copies of one ``tokenizer.json`` anywhere hash alike."""
    if isinstance(tokenizer, ByteTokenizer):
        return None
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What a restore of tokenized-text positions must find again: ``{"tokenizer": ...,
    "byte_offset": ...}``, ``"byte"`` and its offset for a :class:`ByteTokenizer`, else
    ``"sha256:<tokenizer_hash>"`` of the Hugging Face tokenizer (found inside a wrapper or a
    ``transformers`` tokenizer) and None; ``"tokenizer"`` None when it cannot be told."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"tokenizer": "byte", "byte_offset": int(tokenizer.offset)}
    for inner in (
        tokenizer,
        getattr(tokenizer, "tokenizer", None),  # an as_encoder wrapper
        getattr(tokenizer, "backend_tokenizer", None),  # a transformers fast tokenizer
        getattr(getattr(tokenizer, "tokenizer", None), "backend_tokenizer", None),
    ):
        if isinstance(inner, ByteTokenizer):
            return tokenizer_identity(inner)
        if callable(getattr(inner, "to_str", None)):
            try:
                return {"tokenizer": f"sha256:{tokenizer_hash(inner)}", "byte_offset": None}
            except Exception:  # not a tokenizers.Tokenizer after all: unknown
                break
    return {"tokenizer": None, "byte_offset": None}


_ROLES = {
    "bos_token": "a document start",
    "eos_token": "a document end",
    "pad_token": "padding",
    "bol_token": "a sequence start",
    "eol_token": "a sequence end",
}


def _span(lo: int, hi: int) -> str:
    """The closed id range ``lo..hi`` for messages."""
    return str(lo) if lo == hi else f"{lo}..{hi}"


# ids the model reads or predicts: they must be rows of its embedding, so inside the vocabulary
# of a tokenizer whose vocabulary is fixed (a tokenizer.json; the byte tokenizer's grows with
# the special ids it is given). Padding is masked out of the loss and may lie beyond it.
_IN_VOCAB = ("bos_token", "eos_token", "bol_token", "eol_token")


def _vocab_top(ids: TokenIds | None, name: str) -> int | None:
    """The largest id ``name`` may take for ``ids``' vocabulary (None: no such bound)."""
    if ids is None or ids.byte_offset is not None or not ids.vocab_size or name not in _IN_VOCAB:
        return None
    return ids.vocab_size - 1


def _allowed(ids: TokenIds | None, top: int, dtype: str) -> str:
    """The ids in ``0..top`` that ``ids`` never emits for ordinary text, for messages
    (``dtype``: what bounds them, e.g. ``"int64"``)."""
    free, lo = [], 0
    for a, b in ids.ordinary if ids is not None else ():
        if a > top:
            break
        if a > lo:
            free.append(_span(lo, a - 1))
        lo = max(lo, b)
    if lo <= top:
        free.append(_span(lo, top))
    text = " or ".join(free) if free else "none"
    out = f"{text} ({dtype})"
    if ids is not None and ids.specials:
        more = ", ..." if len(ids.specials) > 8 else ""
        out += f", or one of its special tokens [{', '.join(map(str, ids.specials[:8]))}{more}]"
    return out


def check_special_tokens(
    tokens: Mapping[str, int | None],
    *,
    dtype: str,
    ids: TokenIds | None = None,
    source: str = "",
) -> None:
    """Refuse special token ids that the output cannot hold or the tokenizer can emit.

    Args:
        tokens: argument name -> id (None: not used), e.g. ``{"eos_token": 0}``; the names
            are quoted in errors (``bos_token``, ``eos_token``, ``pad_token``, ...).
        dtype: the NumPy name of the integer dtype the ids are stored in (``"uint32"``,
            ``"int32"``, ``"int64"``); ids must lie in ``0..max`` of it.
        ids: what the tokenizer emits (:func:`token_ids`), or None when unknown (only the
            dtype range is checked).
        source: where ``ids`` comes from, appended to the message (e.g. a metadata file).

    Raises:
        TypeError: an id is not an integer.
        ValueError: an id is outside the dtype, or is an ordinary token of the tokenizer (it
            would turn every occurrence of that token in the text into a document end, ...);
            the message names the argument, its value, the reason and the ids allowed.
    """
    top = int(np.iinfo(np.dtype(dtype)).max)
    where = f" ({source})" if source else ""
    for name, value in tokens.items():
        if value is None:
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}={value!r} must be None or an integer token id")
        value = int(value)
        vocab_top = _vocab_top(ids, name)
        bound, label = (top, dtype) if vocab_top is None else (vocab_top, "in its vocabulary")
        if not 0 <= value <= top:
            free = "" if ids is None else f"; the tokenizer never emits {_allowed(ids, top, dtype)}"
            raise ValueError(
                f"{name}={value} must be a token id in 0..{top} (the output dtype {dtype}){free}"
            )
        if ids is not None and vocab_top is not None and value > vocab_top:
            raise ValueError(
                f"{name}={value} is beyond the vocabulary of the tokenizer {ids.name}{where} "
                f"(vocab_size {ids.vocab_size}): the model has no embedding for it; choose an "
                f"id the tokenizer never emits: {_allowed(ids, bound, label)}"
            )
        if ids is not None and ids.is_ordinary(value):
            role = _ROLES.get(name, "a special token")
            raise ValueError(
                f"{name}={value} is an ordinary token ({ids.what(value)}) of the tokenizer "
                f"{ids.name}{where}: every one in the text would read as {role}; choose an id "
                f"the tokenizer never emits: {_allowed(ids, bound, label)}"
            )
