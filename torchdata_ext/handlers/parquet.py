"""Parquet files (``.parquet``): one document per row.

The document column ``col_name`` (default ``"tokens"``) is a ``list<integer>`` (tokens) or a
``string`` (text) column. Only that column is decoded, one row group at a time, when a
document in the row group is first asked for; decoded row groups are kept (all of them by
default, or the ``max_cached_row_groups`` most recently used). Local files are memory-mapped;
files on other filesystems are fetched once with ``fs.cat_file``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from torchdata_ext.handlers.arrow import RowColumn, column_kind
from torchdata_ext.handlers.base import DataFileError, FileHandler
from torchdata_ext.handlers.numpy_tokens import check_index, check_indices, read_source

__all__ = ["ParquetHandler", "ParquetReader"]


class ParquetReader:
    """An opened Parquet file.

    Attributes:
        url: the file.
        produces: ``"tokens"`` or ``"text"``.
        row_group_starts: int64 global index of the first row of each row group, plus the total.
        num_docs: number of rows.
    """

    def __init__(
        self,
        url: str,
        col_name: str,
        parquet_file: Any,
        produces: str,
        max_cached_row_groups: int | None,
    ) -> None:
        self.url = url
        self.col_name = col_name
        self.parquet_file = parquet_file
        self.produces = produces
        self.max_cached_row_groups = max_cached_row_groups
        md = parquet_file.metadata
        counts = np.array(
            [md.row_group(r).num_rows for r in range(md.num_row_groups)], dtype=np.int64
        )
        self.row_group_starts = np.zeros(counts.size + 1, dtype=np.int64)
        np.cumsum(counts, out=self.row_group_starts[1:])
        self.num_docs = int(self.row_group_starts[-1])
        self._cache: OrderedDict[int, RowColumn] = OrderedDict()
        self._lengths: np.ndarray | None = None

    def row_group(self, r: int) -> RowColumn:
        """The decoded document column of row group ``r`` (cached)."""
        rows = self._cache.get(r)
        if rows is not None:
            self._cache.move_to_end(r)
            return rows
        try:
            table = self.parquet_file.read_row_group(r, columns=[self.col_name], use_threads=False)
        except (pa.ArrowException, OSError) as exc:
            raise DataFileError(
                self.url,
                f"cannot decode column {self.col_name!r} of row group {r} ({exc}); the file is "
                "corrupt or truncated - re-create or re-download it",
            ) from exc
        rows = RowColumn(
            self.url, self.col_name, table.column(0).chunks, text=self.produces == "text"
        )
        self._cache[r] = rows
        limit = self.max_cached_row_groups
        if limit is not None:
            while len(self._cache) > max(limit, 1):
                self._cache.popitem(last=False)
        return rows

    def locate(self, i: int) -> tuple[int, int]:
        r = int(np.searchsorted(self.row_group_starts, i, side="right")) - 1
        return r, i - int(self.row_group_starts[r])

    def __len__(self) -> int:
        return self.num_docs

    def close(self) -> None:
        """Drop the file and the decoded row groups (documents handed out stay valid)."""
        self._cache.clear()
        self.parquet_file = None

    def __enter__(self) -> ParquetReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ParquetReader({self.url!r}, produces={self.produces!r}, docs={self.num_docs})"


class ParquetHandler(FileHandler):
    """Parquet files, one document per row of a ``list<int>`` or ``string`` column.

    Args:
        col_name: the document column, default ``"tokens"``. A missing column is an error even
            when a ``text`` column exists (the message says so): pass ``col_name="text"``.
        storage_options: fsspec keyword arguments.
        max_cached_row_groups: decoded row groups kept per reader (least recently used are
            dropped); None (default) keeps all, so random access decodes each row group once.

    Token documents are zero-copy slices of the decoded column (the decode itself is a copy out
    of the Parquet pages). The class attribute ``produces`` is ``"tokens"``; ask
    :meth:`produces_for` for a given reader.
    """

    name: ClassVar[str] = "parquet"
    suffixes: ClassVar[tuple[str, ...]] = (".parquet",)
    produces: ClassVar[str] = "tokens"

    def __init__(
        self,
        col_name: str = "tokens",
        storage_options: dict[str, Any] | None = None,
        max_cached_row_groups: int | None = None,
    ) -> None:
        super().__init__(col_name, storage_options)
        if max_cached_row_groups is not None and max_cached_row_groups < 1:
            raise ValueError(f"{max_cached_row_groups=} must be >= 1 or None")
        self.max_cached_row_groups = max_cached_row_groups

    def open(self, url: str) -> ParquetReader:
        buf = read_source(url, self.storage_options)
        try:
            parquet_file = pq.ParquetFile(pa.BufferReader(pa.py_buffer(buf)))
            schema = parquet_file.schema_arrow
        except (pa.ArrowException, OSError) as exc:
            raise DataFileError(
                url,
                f"not a Parquet file, or truncated ({exc}); re-create or re-download the file",
            ) from exc
        _, kind = column_kind(url, schema, self.col_name, "Parquet")
        if kind == "int":
            raise DataFileError(
                url,
                f"column {self.col_name!r} has type {schema.field(self.col_name).type}: one "
                "token per row; Parquet documents are one row each, so the column must be "
                "list<integer> (tokens) or string (text) - pass col_name=... or re-write the "
                "file with one token list per row",
            )
        return ParquetReader(
            url,
            self.col_name,
            parquet_file,
            "text" if kind == "text" else "tokens",
            self.max_cached_row_groups,
        )

    def produces_for(self, reader: ParquetReader) -> str:
        """``"tokens"`` or ``"text"``: what :meth:`get` returns for this reader."""
        return reader.produces

    def length(self, reader: ParquetReader) -> int:
        return reader.num_docs

    def get(self, reader: ParquetReader, index: int) -> Any:
        r, j = reader.locate(check_index(reader.url, index, reader.num_docs))
        return reader.row_group(r).get(j)

    def get_many(self, reader: ParquetReader, indices: Sequence[int] | np.ndarray) -> list[Any]:
        idx = check_indices(reader.url, indices, reader.num_docs)
        if idx.size == 0:
            return []
        groups = np.searchsorted(reader.row_group_starts, idx, side="right") - 1
        local = idx - reader.row_group_starts[groups]
        out: list[Any] = [None] * idx.size
        for r in np.unique(groups).tolist():
            where = np.flatnonzero(groups == r)
            docs = reader.row_group(r).get_many(local[where])
            for w, doc in zip(where.tolist(), docs, strict=True):
                out[w] = doc
        return out

    def doc_lengths(self, reader: ParquetReader) -> np.ndarray:
        """Per-row lengths; decodes every row group of the column once (then cached)."""
        if reader._lengths is None:
            parts = [np.zeros(0, dtype=np.int64)]
            parts += [
                reader.row_group(r).lengths() for r in range(reader.row_group_starts.size - 1)
            ]
            reader._lengths = np.concatenate(parts)
        return reader._lengths

    def close(self, reader: ParquetReader) -> None:
        reader.close()
