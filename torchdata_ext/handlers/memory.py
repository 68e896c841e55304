"""Documents held in memory (epochraft's ``from_sequence``), as a dataset of virtual files.

A :class:`MemorySource` holds one column of documents as Arrow data: a list of token arrays or
of lists of ints (gathered once into one values array and an offsets array, wrapped without a
copy), a list of texts, a ``pyarrow`` table / array / chunked array, or a Hugging Face
``datasets.Dataset`` (its Arrow table, ``ds.data.table``, read in place: no row-by-row Python).
:meth:`~torchdata_ext.sources.index.DatasetIndex.from_documents` cuts it into virtual files of
``docs_per_file`` rows named ``<memory>/<dataset>/part-00000``..., read by
:class:`MemoryHandler` through the same row reader as Arrow/Parquet files
(:class:`~torchdata_ext.handlers.arrow.RowColumn`: token documents are zero-copy NumPy views),
so the reader's logical shards, random walk, state, restore and rescale apply unchanged.

Handed to worker processes, a source pickles its Arrow data (a copy per worker with the
``spawn`` start method; none with ``fork``); a Hugging Face dataset read from disk pickles as
its file paths (``datasets`` memory-maps them again), not as its data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from torchdata_ext.handlers.arrow import RowColumn, column_kind
from torchdata_ext.handlers.base import DataFileError, FileHandler

__all__ = ["MEMORY_PREFIX", "MemoryHandler", "MemorySource"]

MEMORY_PREFIX = "<memory>"
"""The start of a virtual file name: ``<memory>/<dataset>/part-00000`` (never a real path)."""


class MemorySource:
    """One column of in-memory documents, cut into virtual files of ``docs_per_file`` rows.

    Args:
        name: the dataset name (in file names and errors).
        data: the documents: a sequence (or any iterable, read once into a list) of 1-D integer
            token arrays (or lists of ints) or of ``str``, a ``pyarrow.Table`` / ``RecordBatch`` (with ``column``), a
            ``pyarrow`` list<int> or string ``Array`` / ``ChunkedArray``, or a Hugging Face
            ``datasets.Dataset`` (with ``column``).
        column: the token (list<int>) or text (string) column of a table or dataset; default
            ``"tokens"``.
        docs_per_file: rows per virtual file (the unit the reader opens; file names and the
            held-out split depend on it, so keep it fixed for the life of a run).
    """

    def __init__(
        self, name: str, data: Any, column: str | None = None, docs_per_file: int = 8192
    ) -> None:
        if isinstance(docs_per_file, bool) or not isinstance(docs_per_file, int):
            raise TypeError(f"{docs_per_file=} must be an integer")
        if docs_per_file < 1:
            raise ValueError(f"{docs_per_file=} must be >= 1")
        self.name = str(name)
        self.col_name = column or "tokens"
        self.docs_per_file = docs_per_file
        self._data = _as_arrow(self.name, data, column)
        self._column: pa.ChunkedArray | None = None
        schema = pa.schema([(self.col_name, self.column.type)])
        if column_kind(self.url(), schema, self.col_name, "in-memory")[1] == "int":
            raise DataFileError(
                self.url(),
                f"column {self.col_name!r} holds single integers; in-memory documents are a "
                "list<integer> column (one document per row) or a string column",
            )

    # -- pickling: the Arrow data (or the datasets table, which pickles as its paths) ----------
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_column": None}

    @property
    def column(self) -> pa.ChunkedArray:
        """The documents, one per row."""
        if self._column is None:
            data = self._data
            table = getattr(data, "table", data)  # a datasets Table wraps a pyarrow Table
            if isinstance(table, pa.Table):
                col = table.column(self.col_name)
            elif isinstance(table, pa.Array):
                col = pa.chunked_array([table])
            else:
                col = table
            self._column = col
        return self._column

    @property
    def text(self) -> bool:
        t = self.column.type
        return bool(pa.types.is_string(t) or pa.types.is_large_string(t))

    def __len__(self) -> int:
        return len(self.column)

    # -- virtual files -------------------------------------------------------------------------
    def url(self, file: int | None = None) -> str:
        """The virtual name of file number ``file`` (None: of the whole source)."""
        base = f"{MEMORY_PREFIX}/{self.name}"
        return base if file is None else f"{base}/part-{file:05d}"

    def files(self) -> tuple[str, ...]:
        n = -(-len(self) // self.docs_per_file)
        return tuple(self.url(f) for f in range(n))

    def file_number(self, url: str) -> int:
        prefix = self.url() + "/part-"
        tail = url[len(prefix) :] if url.startswith(prefix) else ""
        if not tail.isdigit() or int(tail) * self.docs_per_file >= max(len(self), 1):
            raise DataFileError(url, f"not a file of the in-memory dataset {self.name!r}")
        return int(tail)

    def rows(self, file: int) -> RowColumn:
        """The rows of virtual file ``file``, zero-copy."""
        lo = file * self.docs_per_file
        part = self.column.slice(lo, min(self.docs_per_file, len(self) - lo))
        return RowColumn(self.url(file), self.col_name, part.chunks, self.text)

    def doc_counts(self) -> np.ndarray:
        n = len(self)
        counts = np.full(len(self.files()), self.docs_per_file, np.int64)
        if len(counts):
            counts[-1] = n - self.docs_per_file * (len(counts) - 1)
        return counts

    def token_counts(self) -> np.ndarray:
        """Tokens per virtual file (-1 each for text)."""
        files = len(self.files())
        if self.text:
            return np.full(files, -1, np.int64)
        return np.array([int(self.rows(f).lengths().sum()) for f in range(files)], np.int64)

    def __repr__(self) -> str:
        return f"MemorySource({self.name!r}, {len(self)} documents, column={self.column.type})"


class MemoryHandler(FileHandler):
    """The handler of :class:`MemorySource` virtual files (format ``"memory"``).

    Args:
        source: the in-memory documents.
        col_name: unused (the source names its column); kept for the handler interface.
        storage_options: unused.
    """

    name: ClassVar[str] = "memory"

    def __init__(
        self,
        source: MemorySource,
        col_name: str = "tokens",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(source, MemorySource):
            raise TypeError(f"source must be a MemorySource, got {type(source).__name__}")
        super().__init__(source.col_name, storage_options)
        self.source = source

    def open(self, url: str) -> RowColumn:
        return self.source.rows(self.source.file_number(url))

    def length(self, reader: RowColumn) -> int:
        return len(reader)

    def get(self, reader: RowColumn, index: int) -> Any:
        return reader.get(index)

    def get_many(self, reader: RowColumn, indices: Sequence[int] | np.ndarray) -> list[Any]:
        return reader.get_many(indices)

    def produces_for(self, reader: RowColumn) -> str:
        return "text" if reader.text else "tokens"

    def doc_lengths(self, reader: RowColumn) -> np.ndarray:
        return reader.lengths()

    def __repr__(self) -> str:
        return f"MemoryHandler({self.source!r})"


def _as_arrow(name: str, data: Any, column: str | None) -> Any:
    """``data`` as Arrow data: a table, an array, a chunked array, or a ``datasets`` table
    wrapper (kept as it is: it pickles as its file paths)."""
    where = f"{MEMORY_PREFIX}/{name}"
    if hasattr(data, "_indices") and hasattr(data, "features") and hasattr(data, "data"):
        if data._indices is not None:  # a datasets.Dataset after select/shuffle/filter
            raise ValueError(
                f"{where}: the datasets.Dataset has an indices mapping (from select, shuffle, "
                "filter or sort); call ds = ds.flatten_indices() first so its Arrow table holds "
                "exactly its rows"
            )
        data = data.data
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    table = getattr(data, "table", data)
    if isinstance(table, pa.Table):
        col = column or "tokens"
        if col not in table.column_names:
            hint = " (pass column='text' to read text)" if "text" in table.column_names else ""
            raise ValueError(
                f"{where}: column={col!r} not found; columns are {table.column_names}; pass "
                f"column=...{hint}"
            )
        return data
    if isinstance(data, (pa.Array, pa.ChunkedArray)):
        return data
    if isinstance(data, Iterable) and not isinstance(data, (str, bytes, Sequence)):
        data = list(data)  # epochraft's from_iterable: random access needs the documents held
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence):
        raise TypeError(
            f"{where}: documents must be a sequence of token arrays or of str, a pyarrow "
            f"Table/Array or a datasets.Dataset; got {type(data).__name__}"
        )
    if not len(data):
        raise ValueError(f"{where}: no documents given; pass at least one")
    if all(isinstance(d, str) for d in data):
        return pa.array(list(data), pa.large_string())
    arrays = [np.asarray(d) for d in data]
    bad = next((i for i, a in enumerate(arrays) if a.ndim != 1 or a.dtype.kind not in "iu"), None)
    if bad is not None:
        a = arrays[bad]
        if a.size or a.ndim != 1:  # an empty list comes out as float64: an empty document
            raise TypeError(
                f"{where}: document {bad} is a {a.ndim}-D {a.dtype} array; documents must all be "
                "1-D integer token arrays (or lists of ints), or all str"
            )
    lengths = np.fromiter(map(len, arrays), np.int64, len(arrays))
    offsets = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    kinds = [a for a in arrays if a.size]
    dtype = np.result_type(*kinds) if kinds else np.dtype(np.int32)
    if dtype.kind not in "iu":  # e.g. uint64 with int64
        dtype = np.dtype(np.int64)
    values = np.concatenate(kinds).astype(dtype, copy=False) if kinds else np.zeros(0, dtype)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
