"""The file-handler interface and the registry of formats by name and suffix.

A handler knows one file format through four operations (the Bamba ``FileHandler``):

* ``open(url)`` returns an opened reader object (held by the caller, never put in state);
* ``length(reader)`` is the number of documents in the file;
* ``get(reader, i)`` returns document ``i``: a 1-D NumPy integer array of token ids for
  tokenized formats (zero-copy from Arrow or a memory map where the format allows), or a
  ``str`` for text formats;
* ``slice(doc, start, n)`` returns tokens (or characters) ``start .. start + n`` of a document
  returned by ``get``.

Users add a format by subclassing :class:`FileHandler` and calling :func:`register_handler`.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from torchdata_ext.handlers.ranged import OpenRanges

__all__ = [
    "READ_ERRORS",
    "DataFileError",
    "drop_resident_pages",
    "DocData",
    "FileHandler",
    "format_for_url",
    "get_handler",
    "get_handler_class",
    "handler_accepts",
    "handler_for_url",
    "register_handler",
    "registered_formats",
]

DocData = np.ndarray | str
"""What a handler returns for one document: a 1-D integer token array, or text."""


class DataFileError(ValueError):
    """A data file is missing, truncated, corrupt, or lacks the expected field.

    Attributes:
        url: the file at fault.
    """

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


READ_ERRORS: tuple[type[BaseException], ...] = (
    DataFileError,
    OSError,  # missing or unreadable files, remote errors (RemoteError is one), bad gzip data
    EOFError,
    UnicodeDecodeError,
    json.JSONDecodeError,
    pa.ArrowException,
)
"""What opening or reading a bad file raises: :class:`DataFileError` (every built-in handler's
word for a missing, truncated or corrupt file), ``OSError`` and the decoding errors a handler
may let through. ``on_error="skip"`` skips these only: anything else (a ``TypeError``, an
``AttributeError``...) is a bug and propagates."""


class FileHandler(ABC):
    """One file format. Subclasses set ``name``, ``suffixes`` and ``produces``.

    Args:
        col_name: the field holding each document (a token column, or a text field).
        storage_options: fsspec keyword arguments (credentials, endpoint, ...) used by ``open``.

    Handlers hold configuration only: the opened reader returned by :meth:`open` carries all
    per-file resources, so a handler can be shared, pickled and sent to worker processes.
    """

    name: ClassVar[str] = ""
    suffixes: ClassVar[tuple[str, ...]] = ()
    produces: ClassVar[str] = "tokens"  # "tokens" or "text"
    range_reads_always: ClassVar[bool] = False
    """True: a remote file of this format is always opened by :meth:`open_ranged`, never
    downloaded whole into a cache (its files may be far larger than any cache)."""

    def __init__(
        self, col_name: str = "tokens", storage_options: dict[str, Any] | None = None
    ) -> None:
        self.col_name = col_name
        self.storage_options = dict(storage_options or {})

    @abstractmethod
    def open(self, url: str) -> Any:
        """Open ``url`` and return a reader object for :meth:`length` and :meth:`get`.

        Raises:
            DataFileError: the file is missing, corrupt, or lacks ``col_name``. A reader skips
                only files and documents failing with one of :data:`READ_ERRORS`.
        """

    @abstractmethod
    def length(self, reader: Any) -> int:
        """Number of documents in the opened file."""

    @abstractmethod
    def get(self, reader: Any, index: int) -> DocData:
        """Document ``index`` (0-based) of the opened file."""

    def open_ranged(self, url: str, open_ranges: OpenRanges) -> Any | None:
        """Open the remote file ``url`` reading only the byte ranges it needs, through
        ``open_ranges(u)`` (``u``: ``url`` or a side file next to it), instead of fetching it.

        Used for remote files when the format sets :attr:`range_reads_always`, or when the
        reader's cache is a ``ShardCache(range_reads=True)``. Returns None when this file
        cannot be read by range (it is then downloaded whole); the default does so.
        """
        return None

    def slice(self, doc: DocData, start: int, n: int) -> DocData:
        """Tokens (or characters) ``start .. start + n`` of ``doc``."""
        return doc[start : start + n]

    def get_many(self, reader: Any, indices: Sequence[int] | np.ndarray) -> list[DocData]:
        """Documents at ``indices``, in that order. Formats override this for speed."""
        return [self.get(reader, int(i)) for i in indices]

    def produces_for(self, reader: Any) -> str:
        """``"tokens"`` or ``"text"``: what :meth:`get` returns for this opened file."""
        return str(getattr(reader, "produces", self.produces))

    def doc_lengths(self, reader: Any) -> np.ndarray | None:
        """Length of every document (tokens, or characters for text) if cheap, else None."""
        return None

    def close(self, reader: Any) -> None:  # noqa: B027 - optional hook
        """Release the reader's resources."""

    def release_pages(self, reader: Any) -> None:
        """Drop the pages of a local file's memory map that this process has read from its
        resident set, keeping the reader open (called for files kept open between uses).
        The bytes stay in the operating system's page cache and are mapped back on the next
        access; arrays already handed out stay valid. Default: the memory map behind the
        reader's ``source`` (the Arrow reader's file) or ``tokens`` (the token-array
        readers'), if any."""
        for name in ("source", "tokens"):
            drop_resident_pages(getattr(reader, name, None))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(col_name={self.col_name!r})"


def drop_resident_pages(buffer: Any) -> None:
    """``madvise(MADV_DONTNEED)`` over a read-only shared file mapping (an ``mmap.mmap``, or
    the one a NumPy array is a view of): its pages leave this process's resident set (RSS),
    not the page cache; reading them again maps them back (a minor fault). Anything else, or
    a platform without ``madvise``, is left as it is."""
    import mmap

    for _ in range(8):  # a view of a view of ... the map (np.frombuffer, slices, memoryview)
        if isinstance(buffer, np.ndarray):
            buffer = buffer.base
        elif isinstance(buffer, memoryview):
            buffer = buffer.obj
        else:
            break
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if isinstance(buffer, mmap.mmap) and advice is not None and not buffer.closed:
        with contextlib.suppress(OSError, ValueError):  # e.g. an empty map: nothing resident
            buffer.madvise(advice)


# name -> "module:Class" (lazy) or a class
_REGISTRY: dict[str, str | type[FileHandler]] = {
    "arrow": "torchdata_ext.handlers.arrow:ArrowHandler",
    "parquet": "torchdata_ext.handlers.parquet:ParquetHandler",
    "ceped": "torchdata_ext.handlers.numpy_tokens:CepedHandler",
    "flat": "torchdata_ext.handlers.numpy_tokens:FlatTokenHandler",
    "npy": "torchdata_ext.handlers.numpy_tokens:NpyHandler",
    "jsonl": "torchdata_ext.handlers.jsonl:JsonlHandler",
    "memory": "torchdata_ext.handlers.memory:MemoryHandler",
    "mds": "torchdata_ext.handlers.mds:MdsHandler",
    "cbor": "torchdata_ext.handlers.cbor:CborHandler",
    "megatron": "torchdata_ext.handlers.megatron:MegatronHandler",
    "llmc": "torchdata_ext.handlers.token_shards:LlmcHandler",
    "nanogpt": "torchdata_ext.handlers.token_shards:NanoGptHandler",
}
# suffix (lower case, longest match wins) -> name
_SUFFIXES: dict[str, str] = {
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".parquet": "parquet",
    ".npy": "npy",
    ".bin": "flat",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".jsonl.gz": "jsonl",
    ".json.gz": "jsonl",
    ".jsonl.zst": "jsonl",
    ".json.zst": "jsonl",
    ".mds": "mds",
    ".mds.zstd": "mds",
    ".mds.zst": "mds",
    ".mds.gz": "mds",
    ".mds.bz2": "mds",
    ".cbor": "cbor",
    ".cbor.gz": "cbor",
    ".cbor.zst": "cbor",
    ".idx": "megatron",
}


def register_handler(
    name: str, handler: type[FileHandler] | str, suffixes: Sequence[str] = ()
) -> None:
    """Register a file format.

    Args:
        name: the format name users pass as ``file_type``.
        handler: a :class:`FileHandler` subclass, or ``"module:Class"`` to import lazily.
        suffixes: file name endings (e.g. ``".cbor"``) that select this format automatically.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{name=} must be a non-empty string")
    _REGISTRY[name] = handler
    for suffix in suffixes:
        _SUFFIXES[suffix.lower()] = name


def registered_formats() -> dict[str, list[str]]:
    """Format name -> the suffixes that select it."""
    out: dict[str, list[str]] = {name: [] for name in _REGISTRY}
    for suffix, name in _SUFFIXES.items():
        out.setdefault(name, []).append(suffix)
    return out


def _resolve(name: str) -> type[FileHandler]:
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown file_type={name!r}; known formats: {sorted(_REGISTRY)}. "
            "Register your own with torchdata_ext.handlers.register_handler"
        ) from None
    if isinstance(target, str):
        module, _, cls = target.partition(":")
        target = getattr(importlib.import_module(module), cls)
        _REGISTRY[name] = target
    return target


def get_handler_class(file_type: str) -> type[FileHandler]:
    """The handler class registered as ``file_type`` (imported on first use).

    Raises:
        ValueError: no format of that name is registered; lists the known names.
    """
    return _resolve(file_type)


def handler_accepts(handler: type[FileHandler], option: str) -> bool:
    """Whether handler class ``handler`` takes keyword argument ``option`` (e.g.
    ``"eos_token"``, which only the flat-token formats need); a ``**kwargs`` takes any."""
    params = inspect.signature(handler.__init__).parameters.values()
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == option and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        for p in params
    )


def get_handler(file_type: str, **options: Any) -> FileHandler:
    """Build the handler registered as ``file_type`` with ``options`` (``col_name``, ...)."""
    return _resolve(file_type)(**options)


def format_for_url(url: str) -> str:
    """The registered format name whose suffix ends ``url`` (longest suffix wins).

    Raises:
        ValueError: no registered suffix matches; names the file and the known suffixes.
    """
    lower = url.lower()
    best = ""
    for suffix in _SUFFIXES:
        if lower.endswith(suffix) and len(suffix) > len(best):
            best = suffix
    if not best:
        raise ValueError(
            f"{url}: unknown file suffix; known suffixes: {sorted(_SUFFIXES)}. "
            "Pass file_type=... explicitly or register a handler for it"
        )
    return _SUFFIXES[best]


def handler_for_url(url: str, file_type: str | None = None, **options: Any) -> FileHandler:
    """The handler for ``url``: ``file_type`` if given, else chosen by the file's suffix."""
    return get_handler(file_type or format_for_url(url), **options)
