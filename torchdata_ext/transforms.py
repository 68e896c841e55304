"""Document transforms: maps and filters applied to whole documents, and the built-ins.

A transform is a step the :class:`~torchdata_ext.nodes.transform.TransformDocuments` node
applies to blocks of whole documents (:class:`~torchdata_ext.document.DocumentBlock`) between
the reader (or tokenize) and interleave. Two kinds:

* :class:`Map`: each document becomes another (its tokens, or its text, changed); a per-document
  function may also return None to drop the document.
* :class:`Filter`: each document is kept or dropped as it is.

Each is written one of two ways: a vectorised ``block_fn`` on a whole block (NumPy in, NumPy
out: the fast path) or a per-document ``fn(data, meta)`` (a convenience; Python per document).
Built-ins (vectorised): :func:`length_filter`, :func:`drop_tokens`, :func:`truncate`, and
:func:`from_spec`, which turns a config entry (``{"min_length": 32}``, a callable, a transform)
into a transform, so YAML configs can use the built-ins.

**Functions must be deterministic**: a document's result may depend only on its data and its
``(dataset, file, doc)``. Restores and rescales rebuild buffered documents from provenance by
reading them again and re-applying the functions, and a dropped document counts as consumed.
The node checks this cheaply (each step applied twice to its first block).

**Errors say where.** An exception raised by a user function comes back as a
:class:`TransformError` naming the step, the dataset, the file and the document index, with the
original exception chained (``__cause__``); a filter's ``fn`` must return a ``bool`` (a
``TypeError`` names the step and what it returned otherwise: the string ``"False"`` is true).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from torchdata_ext.checks import check_int
from torchdata_ext.document import Document, DocumentBlock

__all__ = [
    "Filter",
    "Map",
    "Transform",
    "TransformError",
    "drop_tokens",
    "from_spec",
    "length_filter",
    "take_documents",
    "truncate",
]

On = Literal["tokens", "text"]
SPEC_KEYS = ("min_length", "max_length", "drop_tokens", "truncate")
_SLICE_COPY_DOCS = 256  # up to this many kept documents are copied slice by slice


def _readonly(block: DocumentBlock) -> DocumentBlock:
    """``block`` whose token array a user function cannot write to (a view)."""
    if block.tokens is None or not block.tokens.flags.writeable:
        return block
    view = block.tokens.view()
    view.flags.writeable = False
    return DocumentBlock(
        block.dataset,
        view,
        block.texts,
        block.offsets,
        block.file,
        block.doc,
        block.start,
        block.last,
        block.shard,
        block.epoch,
        block.stop,
    )


def take_documents(block: DocumentBlock, keep: np.ndarray) -> DocumentBlock:
    """The documents of ``block`` where ``keep`` (bool, one per document) is True, in order
    (tokens gathered in one vectorised step)."""
    if keep.all():
        return block
    idx = np.flatnonzero(keep)
    offsets = block.offsets
    lengths = offsets[1:][idx] - offsets[:-1][idx]
    new_off = np.zeros(len(idx) + 1, np.int64)
    np.cumsum(lengths, out=new_off[1:])
    tokens = texts = None
    if block.tokens is not None and 0 < len(idx) <= _SLICE_COPY_DOCS:  # a slice copy each
        lo = offsets[:-1][idx].tolist()
        tokens = np.concatenate([block.tokens[a : a + n] for a, n in zip(lo, lengths.tolist())])
    elif block.tokens is not None:
        shift = np.repeat(offsets[:-1][idx] - new_off[:-1], lengths)
        tokens = block.tokens[np.arange(int(new_off[-1]), dtype=np.int64) + shift]
    else:
        assert block.texts is not None
        texts = [block.texts[i] for i in idx.tolist()]
    return DocumentBlock(
        block.dataset,
        tokens,
        texts,
        new_off,
        block.file[idx],
        block.doc[idx],
        block.start[idx],
        block.last[idx],
        block.shard,
        block.epoch,
        None if block.stop is None else block.stop[idx],
    )


class TransformError(RuntimeError):
    """A user function of a transform step raised: the message names the step, the dataset,
    the file and the document (index in its file) it was applied to, and the original
    exception is chained as ``__cause__``.

    Attributes:
        where: ``(dataset, file number, document)`` for a per-document function, or None
            (a per-block function: the message names the block's files).
        step: the step's name.
    """

    def __init__(
        self, message: str, where: tuple[str, int, int] | None = None, step: str = ""
    ) -> None:
        super().__init__(message)
        self.where, self.step = where, step

    @classmethod
    def of(
        cls, step: str, err: BaseException, where: tuple[str, int, int], file_name: str = ""
    ) -> TransformError:
        """The error for ``err`` raised by step ``step`` on document ``where``."""
        text = f"{type(err).__name__}: {err} (on {_where(*where, file_name)})"
        return cls(f"transform {step!r} raised {text}", where, step)


def _where(dataset: str, file: int, doc: int, file_name: str = "") -> str:
    named = f"file {file} ({file_name})" if file_name else f"file {file}"
    return f"dataset {dataset!r}, {named}, document {doc}"


def _doc_where(block: DocumentBlock, i: int) -> str:
    return _where(block.dataset, int(block.file[i]), int(block.doc[i]))


def _call(step: Transform, fn: Callable, block: DocumentBlock, i: int, data: Any) -> Any:
    """``fn(data, meta)`` for document ``i``; an exception re-raised saying where."""
    try:
        return fn(data, _meta(block, i, data))
    except Exception as err:
        where = (block.dataset, int(block.file[i]), int(block.doc[i]))
        raise TransformError.of(step.name, err, where) from err


def _call_block(step: Transform, fn: Callable, block: DocumentBlock) -> Any:
    """``fn(block)``; an exception re-raised saying which block."""
    try:
        return fn(block)
    except Exception as err:
        files = sorted(set(block.file.tolist()))
        docs = block.doc.tolist()
        raise TransformError(
            f"transform {step.name!r} raised {type(err).__name__}: {err} (on a block of "
            f"dataset {block.dataset!r}: {len(block)} documents of file(s) {files}, documents "
            f"{docs[:8]}{'...' if len(docs) > 8 else ''})",
            step=step.name,
        ) from err


def _meta(block: DocumentBlock, i: int, data: np.ndarray | str) -> Document:
    # epoch -1: a function must not depend on it (documents are rebuilt without it)
    return Document(data, block.dataset, int(block.file[i]), int(block.doc[i]), 0, True, -1)


class Transform:
    """A step applied to blocks of whole documents (see the module docstring).

    Attributes:
        on: ``"tokens"`` or ``"text"``: the data the step works on (a text step runs before
            tokenize, a token step after it).
        name: a name for error messages (the function's name by default).
        changes_documents: whether the step may change a document's contents (maps), not only
            drop documents (filters).
        params: a built-in's name and arguments (``{"step": "truncate", "max_tokens": 2048}``);
            None for a user's step.
    """

    on: On = "tokens"
    name: str = "transform"
    changes_documents = False
    params: dict[str, Any] | None = None

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of this step, so a restore with another step or other
        parameters is refused by name: a built-in's name and arguments; for a user's step its
        kind, name, ``on`` and function (module and qualified name, with a ``partial``'s
        arguments). Plain values, the same in every process and run."""
        if self.params is not None:
            return dict(self.params)
        out: dict[str, Any] = {"step": type(self).__name__, "name": self.name, "on": self.on}
        fn = getattr(self, "fn", None) or getattr(self, "block_fn", None)
        if fn is not None:
            out["function"] = _fn_identity(fn)
        return out

    def apply(self, block: DocumentBlock) -> DocumentBlock:
        """The block after this step: a subset of its documents, in order, each possibly
        changed. ``block`` holds whole documents only."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, on={self.on!r})"


def _fn_name(f: Callable) -> str:
    """A function's name for messages and identities (no memory address)."""
    if isinstance(f, functools.partial):
        return f"partial({_fn_name(f.func)})"
    return str(getattr(f, "__name__", None) or type(f).__name__)


def _fn_identity(f: Callable) -> str:
    """``module.qualname`` of a function (of its class for a callable object), with a
    ``partial``'s or a callable object's arguments where their ``repr`` is stable."""
    if isinstance(f, functools.partial):
        args = repr((f.args, sorted(f.keywords.items())))
        return f"{_fn_identity(f.func)}{args if ' at 0x' not in args else ''}"
    owner = f if hasattr(f, "__qualname__") else type(f)
    where = f"{getattr(owner, '__module__', '')}.{owner.__qualname__}"
    attrs = repr(sorted(vars(f).items())) if owner is type(f) and hasattr(f, "__dict__") else ""
    return where + (attrs if " at 0x" not in attrs else "")


def _check_on(on: str) -> On:
    if on not in ("tokens", "text"):
        raise ValueError(f"{on=} must be 'tokens' or 'text'")
    return on  # type: ignore[return-value]


def _check_fns(kind: str, fn: Callable | None, block_fn: Callable | None) -> Callable:
    if (fn is None) == (block_fn is None):
        raise TypeError(f"{kind} takes exactly one of fn (per document) or block_fn (per block)")
    f = fn if fn is not None else block_fn
    if not callable(f):
        raise TypeError(f"{kind}: {f!r} is not callable")
    return f


class Map(Transform):
    """Change each document (and drop some, with a per-document ``fn`` returning None).

    Args:
        fn: ``fn(data, meta) -> new data | None`` per document: ``data`` a read-only 1-D token
            array (``on="tokens"``) or a ``str`` (``on="text"``); ``meta`` a
            :class:`~torchdata_ext.document.Document` (its ``dataset``, ``file``, ``doc``); the
            result a 1-D integer array (or list) of token ids, a ``str`` for text, or None to
            drop the document.
        block_fn: the vectorised form: ``block_fn(block) -> (tokens, offsets)`` for a
            :class:`~torchdata_ext.document.DocumentBlock` of whole token documents: the new
            concatenated tokens and ``len(block) + 1`` offsets (document ``i`` is
            ``tokens[offsets[i]:offsets[i + 1]]``), one per input document; for text,
            ``block_fn(block) -> list[str]``, one per text.
        on: ``"tokens"`` (default) or ``"text"``.
        name: for error messages; default the function's name.

    Both must be deterministic (see the module docstring) and, to run in dataloader worker
    processes, picklable (module-level functions, not lambdas).
    """

    changes_documents = True

    def __init__(
        self,
        fn: Callable[[Any, Document], Any] | None = None,
        *,
        block_fn: Callable[[DocumentBlock], Any] | None = None,
        on: On = "tokens",
        name: str | None = None,
    ) -> None:
        f = _check_fns("Map", fn, block_fn)
        self.fn, self.block_fn, self.on = fn, block_fn, _check_on(on)
        self.name = str(name or _fn_name(f))

    def apply(self, block: DocumentBlock) -> DocumentBlock:
        if not len(block):
            return block
        ro = _readonly(block)
        if self.block_fn is not None:
            return self._from_block_fn(block, _call_block(self, self.block_fn, ro))
        assert self.fn is not None
        n = len(block)
        keep = np.ones(n, bool)
        out: list[Any] = []
        for i in range(n):
            if block.tokens is not None:
                data: np.ndarray | str = ro.tokens[block.offsets[i] : block.offsets[i + 1]]  # type: ignore[index]
            else:
                assert block.texts is not None
                data = block.texts[i]
            res = _call(self, self.fn, block, i, data)
            if res is None:
                keep[i] = False
                continue
            out.append(self._check_result(block, i, res))
        return _rebuilt(
            take_documents(block, keep),
            out,
            f"transform {self.name!r} on dataset {block.dataset!r}",
        )

    def _check_result(self, block: DocumentBlock, i: int, res: Any) -> np.ndarray | str:
        where = f"{self.name} on dataset {block.dataset!r}, file {int(block.file[i])}, doc {int(block.doc[i])}"
        if block.tokens is None:
            if not isinstance(res, str):
                raise TypeError(f"{where}: a text map must return a str or None, got {type(res)}")
            return res
        arr = np.asarray(res)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise TypeError(
                f"{where}: a token map must return a 1-D integer array or None, got "
                f"{arr.dtype} of shape {arr.shape}"
            )
        return arr

    def _from_block_fn(self, block: DocumentBlock, res: Any) -> DocumentBlock:
        where = f"{self.name} on a block of dataset {block.dataset!r}"
        if block.tokens is None:
            if not isinstance(res, Sequence) or len(res) != len(block):
                raise TypeError(f"{where}: a text block_fn must return one str per text")
            return _rebuilt(block, [str(t) for t in res])
        if not (isinstance(res, tuple) and len(res) == 2):
            raise TypeError(f"{where}: block_fn must return (tokens, offsets)")
        tokens, offsets = np.asarray(res[0]), np.asarray(res[1], np.int64)
        if (
            tokens.ndim != 1
            or offsets.shape != (len(block) + 1,)
            or (tokens.size and tokens.dtype.kind not in "iu")
            or offsets[0] != 0
            or offsets[-1] != len(tokens)
            or np.any(np.diff(offsets) < 0)
        ):
            raise ValueError(
                f"{where}: block_fn must return 1-D integer tokens and {len(block) + 1} "
                f"non-decreasing offsets from 0 to len(tokens) (got tokens of shape "
                f"{tokens.shape}, offsets of shape {offsets.shape})"
            )
        return _with_data(block, _cast(tokens, block, where), offsets)


def _cast(tokens: np.ndarray, block: DocumentBlock, where: str) -> np.ndarray:
    assert block.tokens is not None
    dtype = block.tokens.dtype
    if tokens.dtype == dtype:
        return tokens
    if tokens.size:
        info = np.iinfo(dtype)
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < info.min or hi > info.max:
            raise ValueError(
                f"{where}: token ids {lo}..{hi} do not fit the pipeline's {dtype} "
                f"({info.min}..{info.max}); make it return ids of the tokenizer's vocabulary"
            )
    return tokens.astype(dtype)


def _with_data(
    block: DocumentBlock, tokens: np.ndarray | None, offsets: np.ndarray | None = None
) -> DocumentBlock:
    """``block`` with other token data (same documents, whole)."""
    return DocumentBlock(
        block.dataset,
        tokens if block.tokens is not None else None,
        block.texts,
        block.offsets if offsets is None else offsets,
        block.file,
        block.doc,
        block.start,
        np.ones(len(block), bool),
        block.shard,
        block.epoch,
        block.stop,
    )


def _rebuilt(block: DocumentBlock, data: list[Any], where: str = "map") -> DocumentBlock:
    """``block``'s documents with new data, one per document (token arrays or texts);
    ``where`` names the step in errors."""
    n = len(data)
    lengths = np.fromiter(map(len, data), np.int64, n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if block.texts is not None:
        out = _with_data(block, None, offsets)
        out.texts = list(data)
        return out
    assert block.tokens is not None
    flat = np.concatenate(data) if n else np.zeros(0, block.tokens.dtype)
    return _with_data(block, _cast(flat, block, where), offsets)


class Filter(Transform):
    """Keep or drop each document as it is.

    Args:
        fn: ``fn(data, meta) -> bool`` per document (True keeps it); ``data`` a read-only 1-D
            token array or a ``str`` (``on="text"``), ``meta`` a
            :class:`~torchdata_ext.document.Document`.
        block_fn: the vectorised form: ``block_fn(block) -> keep``, a bool array with one entry
            per document of the :class:`~torchdata_ext.document.DocumentBlock`.
        on: ``"tokens"`` (default) or ``"text"``.
        name: for error messages; default the function's name.

    Both must be deterministic and picklable (see :class:`Map`).
    """

    def __init__(
        self,
        fn: Callable[[Any, Document], bool] | None = None,
        *,
        block_fn: Callable[[DocumentBlock], Any] | None = None,
        on: On = "tokens",
        name: str | None = None,
    ) -> None:
        f = _check_fns("Filter", fn, block_fn)
        self.fn, self.block_fn, self.on = fn, block_fn, _check_on(on)
        self.name = str(name or _fn_name(f))

    def keep(self, block: DocumentBlock) -> np.ndarray:
        """The bool keep mask of ``block``'s documents."""
        ro = _readonly(block)
        if self.block_fn is not None:
            keep = np.asarray(_call_block(self, self.block_fn, ro))
            if keep.shape != (len(block),) or keep.dtype != bool:
                raise ValueError(
                    f"{self.name}: block_fn must return a bool array of {len(block)} entries "
                    f"(one per document), got {keep.dtype} of shape {keep.shape}"
                )
            return keep
        assert self.fn is not None
        keep = np.empty(len(block), bool)
        for i in range(len(block)):
            if block.tokens is not None:
                data: Any = ro.tokens[block.offsets[i] : block.offsets[i + 1]]  # type: ignore[index]
            else:
                assert block.texts is not None
                data = block.texts[i]
            res = _call(self, self.fn, block, i, data)
            if not isinstance(res, (bool, np.bool_)):
                raise TypeError(
                    f"filter {self.name!r} returned {_shown(res)} for {_doc_where(block, i)}; "
                    "a filter must return True (keep) or False (drop), e.g. "
                    "`return bool(...)` of one condition"
                    + (" (the string 'False' is true)" if isinstance(res, str) else "")
                )
            keep[i] = res
        return keep

    def apply(self, block: DocumentBlock) -> DocumentBlock:
        if not len(block):
            return block
        return take_documents(block, self.keep(block))


def _shown(value: Any) -> str:
    """``value`` for an error message: its type and a short repr."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    shape = f" of shape {value.shape}" if isinstance(value, np.ndarray) else ""
    return f"{text} (a {type(value).__name__}{shape})"


# -- built-ins ---------------------------------------------------------------------------------
class _LengthKeep:
    def __init__(self, lo: int | None, hi: int | None) -> None:
        self.lo, self.hi = lo, hi

    def __call__(self, block: DocumentBlock) -> np.ndarray:
        n = np.diff(block.offsets)
        keep = np.ones(len(n), bool)
        if self.lo is not None:
            keep &= n >= self.lo
        if self.hi is not None:
            keep &= n <= self.hi
        return keep


def length_filter(min_length: int | None = None, max_length: int | None = None) -> Filter:
    """Keep documents of ``min_length`` to ``max_length`` tokens (both inclusive; None: no
    bound), counted as the document reaches the filter (before the packer's BOS/EOS)."""
    if min_length is None and max_length is None:
        raise ValueError("length_filter needs min_length, max_length or both")
    lo = None if min_length is None else check_int("min_length", min_length, 0)
    hi = None if max_length is None else check_int("max_length", max_length, 0)
    if lo is not None and hi is not None and hi < lo:
        raise ValueError(f"{max_length=} must be >= {min_length=}")
    out = Filter(block_fn=_LengthKeep(lo, hi), name=f"length_filter({lo}, {hi})")
    out.params = {"step": "length_filter", "min_length": lo, "max_length": hi}
    return out


class _NoneOf:
    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens

    def __call__(self, block: DocumentBlock) -> np.ndarray:
        assert block.tokens is not None
        hit = np.isin(block.tokens, self.tokens)
        lengths = np.diff(block.offsets)
        doc_of = np.repeat(np.arange(len(block)), lengths)
        bad = np.bincount(doc_of[hit], minlength=len(block))
        return bad == 0


def drop_tokens(tokens: int | Sequence[int]) -> Filter:
    """Drop every document that contains any of ``tokens`` (token ids)."""
    ids = [tokens] if isinstance(tokens, (int, np.integer)) else list(tokens)
    for t in ids:
        check_int("drop_tokens", t, 0)
    if not ids:
        raise ValueError("drop_tokens needs at least one token id")
    out = Filter(block_fn=_NoneOf(np.asarray(ids, np.int64)), name=f"drop_tokens({ids})")
    out.params = {"step": "drop_tokens", "tokens": [int(t) for t in ids]}
    return out


class _Truncate:
    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, block: DocumentBlock) -> tuple[np.ndarray, np.ndarray]:
        assert block.tokens is not None
        lengths = np.minimum(np.diff(block.offsets), self.n)
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if 0 < len(lengths) <= _SLICE_COPY_DOCS:  # a slice copy each
            lo = block.offsets[:-1].tolist()
            parts = [block.tokens[a : a + n] for a, n in zip(lo, lengths.tolist())]
            return np.concatenate(parts), offsets
        shift = np.repeat(block.offsets[:-1] - offsets[:-1], lengths)
        return block.tokens[np.arange(int(offsets[-1]), dtype=np.int64) + shift], offsets


def truncate(max_tokens: int) -> Map:
    """Cut every document to its first ``max_tokens`` tokens (the rest is dropped)."""
    n = check_int("truncate", max_tokens, 1)
    out = Map(block_fn=_Truncate(n), name=f"truncate({n})")
    out.params = {"step": "truncate", "max_tokens": n}
    return out


def from_spec(spec: Any, on: On = "tokens") -> Transform:
    """A transform from a config entry.

    Args:
        spec: a :class:`Transform`; a callable (a per-document :class:`Map` ``fn(data, meta)``,
            returning None to drop); or a mapping of built-ins: ``{"min_length": 32}``,
            ``{"max_length": 8192}`` (both together: one length filter), ``{"drop_tokens":
            [7, 8]}``, ``{"truncate": 2048}``.
        on: what a bare callable works on (``"text"`` for text datasets).

    Raises:
        ValueError: an unknown key or a bad value, naming it.
    """
    if isinstance(spec, Transform):
        return spec
    if callable(spec):
        return Map(spec, on=on)
    if not isinstance(spec, Mapping) or not spec:
        raise TypeError(
            f"transform {spec!r} must be a Map/Filter, a callable or a mapping with one of "
            f"the keys {list(SPEC_KEYS)} (e.g. {{'min_length': 32}})"
        )
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(
            f"transform {dict(spec)!r}: unknown key(s) {unknown}; use {list(SPEC_KEYS)}"
        )
    lengths = {k: spec[k] for k in ("min_length", "max_length") if k in spec}
    rest = [k for k in spec if k not in lengths]
    if (lengths and rest) or len(rest) > 1:
        raise ValueError(
            f"transform {dict(spec)!r}: give one built-in per entry (min_length and max_length "
            "may go together); list several entries for several steps"
        )
    if lengths:
        return length_filter(lengths.get("min_length"), lengths.get("max_length"))
    key = rest[0]
    if key == "drop_tokens":
        return drop_tokens(spec[key])
    return truncate(spec[key])
