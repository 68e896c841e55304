"""Arrow IPC files and streams (``.arrow``, ``.feather``, ``.ipc``).

The IPC *file* format is tried first, then the IPC *stream* format (which is read fully into
record batches). The layout follows the type of the ``col_name`` column:

* an integer column: the Bamba layout, one document per **record batch** (document ``i`` is
  ``reader.get_batch(i)[col_name]``);
* a ``list<int>`` / ``large_list<int>`` / ``fixed_size_list<int>`` column: one document per
  **row**, with row indices global across record batches (Hugging Face ``datasets``
  ``save_to_disk`` writes such IPC streams, ``data-00000-of-00001.arrow``);
* a ``string`` / ``large_string`` column: one text document per row; the reader then
  ``produces`` ``"text"`` (see :meth:`ArrowHandler.produces_for`).

Null rows of a list or string column read as empty documents; null tokens inside a document
are an error. Local files are memory-mapped and token documents are zero-copy, read-only
NumPy views of the Arrow buffers.

Fast path for the Bamba layout in an IPC *file*: the file's footer gives where every record
batch's metadata is; a batch's metadata is parsed with NumPy when a call first asks for the
batch (many batches at a time: by comparison with a template batch written the same way, else
by reading the flatbuffers), into the offset and length of its token buffer
(:class:`BatchIndex`), so ``get`` / ``get_many`` are slices of one NumPy view of the file, with
no per-document pyarrow call. Batches the index cannot serve (a null token, compression, an
unexpected layout) go through pyarrow as before, and so does everything else (streams,
range-read files). The handler keeps the indexes of the last 16 local files it opened, keyed
by ``(path, size, mtime, ctime, inode, device)`` and checked against the file's tail, so
opening the same file again (one logical shard after another) neither parses anything nor
calls pyarrow; that cache is never pickled.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from torchdata_ext.handlers.arrow_index import BatchIndex, batch_index, index_agrees
from torchdata_ext.handlers.base import DataFileError, FileHandler
from torchdata_ext.handlers.numpy_tokens import check_index, check_indices, read_source
from torchdata_ext.remote.urls import filesystem, is_local

__all__ = ["ArrowHandler", "ArrowReader", "BatchIndex", "batch_index"]

_INDEX_CACHE_FILES = 64  # per process: indexes of the local files opened last
_INDEX_CACHE_BATCHES = 1 << 22  # ... and of at most this many record batches in all

_SUPPORTED = (
    "an integer column (one document per record batch), a list<integer> column (one "
    "document per row) or a string column (one text per row)"
)


def _is_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))


def _is_text(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def column_kind(url: str, schema: pa.Schema, col_name: str, fmt: str) -> tuple[int, str]:
    """Index of ``col_name`` in ``schema`` and its kind: ``"int"``, ``"list"`` or ``"text"``.

    Raises:
        DataFileError: the column is missing, ambiguous, or of an unsupported type.
    """
    names = list(schema.names)
    count = names.count(col_name)
    if count == 0:
        hint = ""
        if "text" in names and col_name != "text":
            hint = " (the file has a text column 'text': pass col_name='text' to read text)"
        raise DataFileError(
            url, f"column {col_name!r} not found; columns are {names}; pass col_name=...{hint}"
        )
    if count > 1:
        raise DataFileError(
            url, f"column name {col_name!r} occurs {count} times; rename the columns"
        )
    index = names.index(col_name)
    t = schema.field(index).type
    if pa.types.is_integer(t):
        return index, "int"
    if _is_list(t) and pa.types.is_integer(t.value_type):
        return index, "list"
    if _is_text(t):
        return index, "text"
    raise DataFileError(
        url,
        f"column {col_name!r} has type {t}; a {fmt} document column must be {_SUPPORTED}; "
        "pass col_name=... naming such a column",
    )


def int_column_to_numpy(url: str, col_name: str, array: pa.Array, where: str) -> np.ndarray:
    """A null-free Arrow integer array as a zero-copy NumPy view."""
    if array.null_count:
        raise DataFileError(
            url,
            f"column {col_name!r} has {array.null_count} null tokens in {where}; "
            "tokens must not be null - fix the file",
        )
    return array.to_numpy(zero_copy_only=True)


class RowColumn:
    """Row-indexed documents over the chunks of one list<int> or string column.

    Row ``i`` is global over the chunks: chunk ``k`` holds rows ``starts[k] .. starts[k+1]``.
    Token rows are zero-copy slices of each chunk's values buffer; text rows are ``str``.
    """

    def __init__(self, url: str, col_name: str, chunks: Sequence[pa.Array], text: bool) -> None:
        self.url = url
        self.text = text
        counts = np.array([len(c) for c in chunks], dtype=np.int64)
        self.starts = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.starts[1:])
        self.n = int(self.starts[-1])
        self.chunks = list(chunks)
        # per chunk: values (numpy), document starts and ends into those values
        self.values: list[np.ndarray] = []
        self.begins: list[np.ndarray] = []
        self.ends: list[np.ndarray] = []
        if text:
            return
        for k, chunk in enumerate(self.chunks):
            where = f"record batch / chunk {k}"
            if pa.types.is_fixed_size_list(chunk.type):
                size = chunk.type.list_size
                # .values ignores the array's slice offset, so add it back
                flat = int_column_to_numpy(url, col_name, chunk.values, where)
                begins = (np.arange(len(chunk), dtype=np.int64) + chunk.offset) * size
                ends = begins + size
            else:
                flat = int_column_to_numpy(url, col_name, chunk.values, where)
                offsets = chunk.offsets.to_numpy()
                begins, ends = offsets[:-1], offsets[1:]
            if chunk.null_count:
                nulls = chunk.is_null().to_numpy(zero_copy_only=False)
                ends = np.where(nulls, begins, ends)
            self.values.append(flat)
            self.begins.append(begins)
            self.ends.append(ends)

    def __len__(self) -> int:
        return self.n

    def _locate(self, i: int) -> tuple[int, int]:
        if len(self.chunks) == 1:
            return 0, i
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return k, i - int(self.starts[k])

    def get(self, index: int) -> Any:
        k, j = self._locate(check_index(self.url, index, self.n))
        if self.text:
            value = self.chunks[k][j].as_py()
            return "" if value is None else value
        return self.values[k][self.begins[k][j] : self.ends[k][j]]

    def get_many(self, indices: Sequence[int] | np.ndarray) -> list[Any]:
        idx = check_indices(self.url, indices, self.n)
        ks = np.searchsorted(self.starts, idx, side="right") - 1
        js = idx - self.starts[ks]
        out: list[Any] = []
        if self.text:
            for k, j in zip(ks.tolist(), js.tolist(), strict=True):
                value = self.chunks[k][j].as_py()
                out.append("" if value is None else value)
            return out
        for k, j in zip(ks.tolist(), js.tolist(), strict=True):
            out.append(self.values[k][self.begins[k][j] : self.ends[k][j]])
        return out

    def lengths(self) -> np.ndarray:
        """Tokens (or characters, for text) per row, int64; null rows count 0."""
        if not self.chunks:
            return np.zeros(0, dtype=np.int64)
        if self.text:
            # imported here: pyarrow.compute takes ~80 ms to import, which every dataloader
            # worker paid before its first batch while only text lengths use it
            import pyarrow.compute as pc

            parts = [
                pc.fill_null(pc.utf8_length(c), 0).to_numpy(zero_copy_only=False)
                for c in self.chunks
            ]
        else:
            parts = [e - b for b, e in zip(self.begins, self.ends, strict=True)]
        return np.concatenate(parts).astype(np.int64, copy=False)


# --------------------------------------------------------------------------- batch index


def _local_path(url: str, storage_options: dict[str, Any]) -> str | None:
    """The local path of ``url`` (None for other filesystems)."""
    if "://" not in url and "::" not in url:
        return url  # a plain path: fsspec's local filesystem
    try:
        fs, path = filesystem(url, storage_options)
    except ValueError:
        return None
    return str(path) if is_local(fs) else None


class _IndexCache:
    """The batch indexes of the local Arrow files opened last in this process, shared by every
    handler (a restore, an evaluation loader or a torchft re-split builds new handlers: they
    find the files' indexes parsed). Keyed by the file's ``(path, size, mtime, ctime, inode,
    device)`` and the column: a file written again (in place too: its ctime moves) is a new
    key, its old index dropped. Forked workers start with their parent's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[Any, ...], tuple[pa.Schema, int, BatchIndex]] = (
            OrderedDict()
        )

    def get(self, key: tuple[Any, ...]) -> tuple[pa.Schema, int, BatchIndex] | None:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
            return hit

    def put(self, key: tuple[Any, ...], entry: tuple[pa.Schema, int, BatchIndex]) -> None:
        with self._lock:
            for old in [k for k in self._entries if k[0][0] == key[0][0]]:
                del self._entries[old]  # an earlier version of the file (or another column)
            self._entries[key] = entry
            while len(self._entries) > 1 and (
                len(self._entries) > _INDEX_CACHE_FILES
                or sum(len(ix) for _, _, ix in self._entries.values()) > _INDEX_CACHE_BATCHES
            ):
                self._entries.popitem(last=False)


_INDEXES = _IndexCache()


def _stat_key(path: str, st: os.stat_result) -> tuple[Any, ...]:
    return (path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _file_key(path: str | None) -> tuple[Any, ...] | None:
    """``(path, size, mtime, ctime, inode, device)`` of a local file; None if not local or gone."""
    if path is None:
        return None
    try:
        return _stat_key(path, os.stat(path))
    except OSError:
        return None


class ArrowReader:
    """An opened Arrow IPC file or stream.

    Attributes:
        url: the file.
        layout: ``"batch"`` (one document per record batch) or ``"rows"`` (one per row).
        produces: ``"tokens"`` or ``"text"``.
        ipc_format: ``"file"`` or ``"stream"``.
        schema: the Arrow schema.
    """

    def __init__(
        self,
        url: str,
        col_name: str,
        col_index: int,
        schema: pa.Schema,
        ipc_format: str,
        layout: str,
        produces: str,
        file_reader: Any = None,
        batches: list[pa.RecordBatch] | None = None,
        rows: RowColumn | None = None,
        index: BatchIndex | None = None,
        source: Any = None,
    ) -> None:
        self.url = url
        self.col_name = col_name
        self.col_index = col_index
        self.schema = schema
        self.ipc_format = ipc_format
        self.layout = layout
        self.produces = produces
        self.file_reader = file_reader
        self.batches = batches
        self.rows = rows
        self.index = index
        self.source = source  # the file's bytes (for the index, and to open lazily)
        self._lengths: np.ndarray | None = None
        self._view: np.ndarray | None = None
        if rows is not None:
            self.num_docs = len(rows)
        elif index is not None:
            self.num_docs = len(index.lengths)
        elif file_reader is not None:
            self.num_docs = int(file_reader.num_record_batches)
        else:
            self.num_docs = len(batches or [])

    @property
    def view(self) -> np.ndarray:
        """The whole file as one token array (only with an ``index``)."""
        if self._view is None:
            assert self.index is not None
            self._view = self.index.view(self.source)
        return self._view

    def batch(self, i: int) -> pa.RecordBatch:
        if self.file_reader is None and self.index is not None and self.source is not None:
            self.file_reader = pa.ipc.open_file(pa.py_buffer(self.source))
        if self.file_reader is not None:
            return self.file_reader.get_batch(i)
        return (self.batches or [])[i]

    def __len__(self) -> int:
        return self.num_docs

    def close(self) -> None:
        """Drop the references to the file (arrays already handed out stay valid)."""
        self.file_reader = None
        self.batches = []
        self.rows = None
        self.index = None
        self.source = None
        self._view = None
        self.num_docs = 0

    def __enter__(self) -> ArrowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ArrowReader({self.url!r}, {self.ipc_format}, layout={self.layout!r}, "
            f"produces={self.produces!r}, docs={self.num_docs})"
        )


class ArrowHandler(FileHandler):
    """Arrow IPC files/streams; layout chosen by the type of ``col_name`` (see module doc).

    Args:
        col_name: the document column, default ``"tokens"``.
        storage_options: fsspec keyword arguments.

    The class attribute ``produces`` is ``"tokens"``; a string column makes that reader produce
    text, so ask :meth:`produces_for` (or ``reader.produces``).
    """

    name: ClassVar[str] = "arrow"
    suffixes: ClassVar[tuple[str, ...]] = (".arrow", ".feather", ".ipc")
    produces: ClassVar[str] = "tokens"

    def __init__(
        self, col_name: str = "tokens", storage_options: dict[str, Any] | None = None
    ) -> None:
        super().__init__(col_name, storage_options)

    def open(self, url: str) -> ArrowReader:
        path = _local_path(url, self.storage_options)
        if path is not None:
            reader = self._open_indexed(url, path)
            if reader is not None:
                return reader
        key = _file_key(path)
        buf = read_source(url, self.storage_options)
        if key is not None and key != _file_key(path):
            key = None  # changed while it was mapped: do not cache its index
        source = pa.py_buffer(buf)
        file_reader = None
        batches: list[pa.RecordBatch] | None = None
        try:
            file_reader = pa.ipc.open_file(source)
            schema, ipc_format = file_reader.schema, "file"
        except (pa.ArrowException, OSError) as file_exc:
            try:
                stream = pa.ipc.open_stream(source)
                batches = list(stream)
                schema, ipc_format = stream.schema, "stream"
            except (pa.ArrowException, OSError) as stream_exc:
                if bytes(buf[:6]) == b"ARROW1":
                    msg = f"Arrow IPC file is truncated or corrupt ({file_exc})"
                else:
                    msg = f"not an Arrow IPC file or stream, or truncated ({stream_exc})"
                raise DataFileError(
                    url,
                    f"{msg}; re-create or re-download the file (Parquet files need "
                    "file_type='parquet'; Feather v1 is not supported)",
                ) from stream_exc
        col_index, kind = column_kind(url, schema, self.col_name, "Arrow")
        if kind == "int":
            fast: BatchIndex | None = None
            if file_reader is not None:
                fast = self._index(key, buf, schema, col_index, file_reader)
            return ArrowReader(
                url, self.col_name, col_index, schema, ipc_format, "batch", "tokens",
                file_reader=file_reader, batches=batches, index=fast, source=buf,
            )  # fmt: skip
        try:
            if file_reader is not None:
                batches = [file_reader.get_batch(k) for k in range(file_reader.num_record_batches)]
            chunks = [b.column(col_index) for b in batches or []]
        except (pa.ArrowException, OSError) as exc:
            raise DataFileError(
                url, f"cannot read the record batches ({exc}); the file is corrupt or truncated"
            ) from exc
        rows = RowColumn(url, self.col_name, chunks, text=kind == "text")
        return ArrowReader(
            url, self.col_name, col_index, schema, ipc_format, "rows",
            "text" if kind == "text" else "tokens", rows=rows,
        )  # fmt: skip

    def _open_indexed(self, url: str, path: str) -> ArrowReader | None:
        """Open a local file whose batch index is cached (None: not cached, or changed)."""
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                hit = _INDEXES.get((_stat_key(path, st), self.col_name))
                if hit is None or st.st_size == 0:
                    return None
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None  # read_source reports it
        schema, col_index, index = hit
        if len(buf) != index.size or buf[-10:] != index.tail:
            return None
        return ArrowReader(
            url, self.col_name, col_index, schema, "file", "batch", "tokens",
            index=index, source=buf,
        )  # fmt: skip

    def _index(
        self,
        key: tuple[Any, ...] | None,
        buf: Any,
        schema: pa.Schema,
        col_index: int,
        file_reader: Any,
    ) -> BatchIndex | None:
        """The batch index of an IPC file opened by pyarrow (None if it does not model it)."""
        try:
            index = batch_index(buf, schema, col_index)
            if index is None or len(index.lengths) != file_reader.num_record_batches:
                return None
            if not index_agrees(index, buf, file_reader, col_index):
                return None
        except (pa.ArrowException, OSError, ValueError, IndexError):
            return None  # pyarrow reports the problem when the batch is read
        if key is not None:
            _INDEXES.put((key, self.col_name), (schema, col_index, index))
        return index

    def produces_for(self, reader: ArrowReader) -> str:
        """``"tokens"`` or ``"text"``: what :meth:`get` returns for this reader."""
        return reader.produces

    def length(self, reader: ArrowReader) -> int:
        return reader.num_docs

    def _batch_doc(self, reader: ArrowReader, i: int) -> np.ndarray:
        try:
            column = reader.batch(i).column(reader.col_index)
        except (pa.ArrowException, OSError) as exc:
            raise DataFileError(
                reader.url,
                f"cannot read record batch {i} ({exc}); the file is corrupt or truncated",
            ) from exc
        return int_column_to_numpy(reader.url, reader.col_name, column, f"record batch {i}")

    def get(self, reader: ArrowReader, index: int) -> Any:
        if reader.rows is not None:
            return reader.rows.get(index)
        i = check_index(reader.url, index, reader.num_docs)
        ix = reader.index
        if ix is not None:
            ix.ensure(reader.source, np.array([i]))
            if ix.fast[i]:
                start = int(ix.starts[i])
                return reader.view[start : start + int(ix.lengths[i])]
        return self._batch_doc(reader, i)

    def get_many(self, reader: ArrowReader, indices: Sequence[int] | np.ndarray) -> list[Any]:
        if reader.rows is not None:
            return reader.rows.get_many(indices)
        idx = check_indices(reader.url, indices, reader.num_docs)
        ix = reader.index
        if ix is None:
            return [self._batch_doc(reader, i) for i in idx.tolist()]
        ix.ensure(reader.source, idx)
        view = reader.view
        starts = ix.starts[idx]
        ends = starts + ix.lengths[idx]
        if ix.fast[idx].all():
            return [view[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
        return [
            view[a:b] if fast else self._batch_doc(reader, i)
            for i, a, b, fast in zip(idx.tolist(), starts.tolist(), ends.tolist(), ix.fast[idx])
        ]

    def doc_lengths(self, reader: ArrowReader) -> np.ndarray:
        if reader._lengths is None:
            if reader.rows is not None:
                reader._lengths = reader.rows.lengths()
            elif reader.index is not None and reader.source is not None:
                reader.index.ensure_all(reader.source)
                lengths = reader.index.lengths
                if (lengths >= 0).all():
                    reader._lengths = lengths.copy()
            if reader._lengths is None:
                reader._lengths = np.array(
                    [reader.batch(i).num_rows for i in range(reader.num_docs)], dtype=np.int64
                )
        return reader._lengths

    def close(self, reader: ArrowReader) -> None:
        reader.close()
