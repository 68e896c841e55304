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
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from torchdata_ext.handlers.base import DataFileError, FileHandler
from torchdata_ext.handlers.numpy_tokens import check_index, check_indices, read_source
from torchdata_ext.urls import filesystem, is_local

__all__ = ["ArrowHandler", "ArrowReader", "BatchIndex", "batch_index"]

_INDEX_CACHE_FILES = 16  # per handler: indexes of the local files opened last
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


_PARSE_GROUP = 64  # batches parsed together when only a few are asked for


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
            parts = [
                pc.fill_null(pc.utf8_length(c), 0).to_numpy(zero_copy_only=False)
                for c in self.chunks
            ]
        else:
            parts = [e - b for b, e in zip(self.begins, self.ends, strict=True)]
        return np.concatenate(parts).astype(np.int64, copy=False)


# --------------------------------------------------------------------------- batch index
_MAGIC = b"ARROW1"
_RECORD_BATCH = 3  # MessageHeader.RecordBatch
_BLOCK = np.dtype([("offset", "<i8"), ("meta", "<i4"), ("pad", "<i4"), ("body", "<i8")])
# buffers per node of the types a column may follow for the index to know its buffers
_FIXED_BUFFERS = 2  # validity + values (also bool bits)
_BINARY_BUFFERS = 3  # validity + offsets + data


def _flat_buffers(t: pa.DataType) -> int | None:
    """IPC buffers of a top-level column of type ``t`` (one field node), or None when ``t``
    has children or a layout this index does not model."""
    if pa.types.is_dictionary(t) or pa.types.is_nested(t):
        return None
    if (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or pa.types.is_temporal(t)
        or pa.types.is_decimal(t)
        or pa.types.is_fixed_size_binary(t)
    ):
        return _FIXED_BUFFERS
    if (
        pa.types.is_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_string(t)
        or pa.types.is_large_binary(t)
    ):
        return _BINARY_BUFFERS
    return None


class _Template(NamedTuple):
    """The metadata of one record batch, to parse the batches written like it by comparison.

    A writer lays out the metadata of every batch of one schema the same way; only values
    (``Message.bodyLength``, ``RecordBatch.length``, the ``FieldNode`` and ``Buffer`` structs)
    differ. A batch whose metadata has the template's length and equals it in every other
    8-byte word has its fields at the template's places.
    """

    meta: int  # metadata bytes (Block.metaDataLength)
    words: np.ndarray  # the metadata as little-endian 8-byte words
    compare: np.ndarray  # which words hold layout (True) rather than values
    node_at: int  # word of the column's FieldNode.length (null_count follows)
    data_at: int  # word of the column's values Buffer.offset (length follows)


class BatchIndex:
    """Where the record batches' tokens are in an Arrow IPC file (Bamba layout).

    Built from the file's footer (:func:`batch_index`); a batch's own metadata is parsed when
    a call first asks for the batch (:meth:`ensure`, vectorised over the batches asked for),
    next to its tokens, so no page of the file is touched for nothing.

    Attributes:
        dtype: the token dtype (little-endian).
        lengths: ``int64`` tokens of each batch (its row count), -1 where unknown or not parsed.
        starts: ``int64`` element offset of each batch's tokens in a ``dtype`` view of the file.
        fast: ``bool`` whether a batch's tokens can be taken as ``view[start:start + length]``
            (parsed, no nulls, no compression, in bounds, aligned); the others go through pyarrow.
        parsed: ``bool`` whether a batch's metadata was parsed.
        size: the file size in bytes the index was built for.
        tail: the file's last 10 bytes (footer length and magic), to detect a changed file.
    """

    def __init__(
        self,
        dtype: np.dtype,
        blocks: np.ndarray,
        node: int,
        buffer: int,
        size: int,
        tail: bytes,
    ) -> None:
        self.dtype = dtype
        self.size = size
        self.tail = tail
        self._node, self._buffer = node, buffer
        self._offset = blocks["offset"].astype(np.int64)
        self._body = self._offset + blocks["meta"].astype(np.int64)
        self._body_len = blocks["body"].astype(np.int64)
        n = len(blocks)
        self.lengths = np.full(n, -1, np.int64)
        self.starts = np.zeros(n, np.int64)
        self.fast = np.zeros(n, bool)
        self.parsed = np.zeros(n, bool)
        self._template: _Template | Literal[False] | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    def view(self, buf: Any) -> np.ndarray:
        """The whole file as one read-only ``dtype`` array (zero-copy)."""
        return np.frombuffer(buf, self.dtype, count=self.size // self.dtype.itemsize)

    def ensure(self, buf: Any, idx: np.ndarray) -> None:
        """Parse the metadata of batches ``idx`` (an ``int64`` array) if not parsed yet.

        A few scattered batches (one document fetched here and there, as when a shuffle
        buffer is rebuilt from provenance) are parsed with their aligned group of
        ``_PARSE_GROUP`` neighbours: one vectorised parse costs about the same for 1 or 64
        batches, and the next fetches nearby find them parsed."""
        todo = idx[~self.parsed[idx]]
        if not len(todo):
            return
        if len(todo) < _PARSE_GROUP:
            base = np.unique(todo // _PARSE_GROUP) * _PARSE_GROUP
            todo = (base[:, None] + np.arange(_PARSE_GROUP)).ravel()
            todo = todo[todo < len(self.parsed)]
            todo = todo[~self.parsed[todo]]
        self._parse(_Bytes(buf), np.unique(todo))

    def ensure_all(self, buf: Any) -> None:
        if not self.parsed.all():
            self._parse(_Bytes(buf), np.flatnonzero(~self.parsed))

    def _parse(self, u8: _Bytes, idx: np.ndarray) -> None:
        """Parse batches ``idx``: by the template where their metadata match it, else by
        reading their flatbuffers (:meth:`_parse_flatbuffers`)."""
        if self._template is None:
            self._template = self._make_template(u8, idx)
            idx = idx[~self.parsed[idx]]
        if self._template:
            idx = self._parse_template(u8, idx, self._template)
        if len(idx):
            self._parse_flatbuffers(u8, idx)

    def _make_template(self, u8: _Bytes, idx: np.ndarray) -> _Template | Literal[False]:
        """The template of the first of batches ``idx`` (False when it cannot be one: an
        unexpected layout, compression, or unaligned metadata)."""
        i = idx[:1]
        pos = self._parse_flatbuffers(u8, i)
        m, meta = int(self._offset[i[0]]), int(self._body[i[0]] - self._offset[i[0]])
        if not (pos["ok"][0] and not pos["compressed"][0] and m % 8 == 0 and meta % 8 == 0):
            return False
        words = u8.view("<u8")[m // 8 : (m + meta) // 8].copy()
        compare = np.ones(len(words), bool)
        values: list[tuple[int, int]] = [  # (byte position, bytes) of values, not layout
            (int(pos["nodes"][0]) + 4, 16 * int(pos["n_nodes"][0])),
            (int(pos["bufs"][0]) + 4, 16 * int(pos["n_bufs"][0])),
            (int(pos["length_at"][0]), 8),
            (int(pos["body_length_at"][0]), 8),
        ]
        for at, nbytes in values:
            if at < 0 or nbytes == 0:
                continue  # absent (the default)
            if (at - m) % 8 or nbytes % 8 or at + nbytes > m + meta:
                return False
            compare[(at - m) // 8 : (at - m + nbytes) // 8] = False
        node_at = (int(pos["nodes"][0]) + 4 + 16 * self._node - m) // 8
        data_at = (int(pos["bufs"][0]) + 4 + 16 * (self._buffer + 1) - m) // 8
        return _Template(meta, words, compare, node_at, data_at)

    def _parse_template(self, u8: _Bytes, idx: np.ndarray, t: _Template) -> np.ndarray:
        """Parse the batches of ``idx`` whose metadata equal the template's but for values:
        their fields are where the template's are. Returns the other batches."""
        m = self._offset[idx]
        cand = (self._body[idx] - m == t.meta) & (m % 8 == 0) & (m >= 8)
        cand &= m <= u8.size - t.meta
        hit = idx[cand]
        if not len(hit):
            return idx
        w = u8.view("<u8")[(m[cand] // 8)[:, None] + np.arange(len(t.words))]
        same = (w[:, t.compare] == t.words[t.compare]).all(axis=1)
        hit, w = hit[same], w[same].view(np.int64)
        length, nulls = w[:, t.node_at], w[:, t.node_at + 1]
        off, blen = w[:, t.data_at], w[:, t.data_at + 1]
        self._store(u8.size, hit, length >= 0, length, nulls, off, blen, np.zeros(len(hit), bool))
        rest = np.ones(len(idx), bool)
        rest[np.flatnonzero(cand)[same]] = False
        return idx[rest]

    def _store(
        self,
        size: int,
        idx: np.ndarray,
        ok: np.ndarray,
        length: np.ndarray,
        nulls: np.ndarray,
        off: np.ndarray,
        blen: np.ndarray,
        compressed: np.ndarray,
    ) -> None:
        """Check the parsed fields of batches ``idx`` against the file and record them."""
        isz = self.dtype.itemsize
        body, body_len = self._body[idx], self._body_len[idx]
        nbytes = length * isz
        start = body + off
        ok = ok & (body_len >= 0) & (body <= size - body_len)
        ok &= (off >= 0) & (blen >= nbytes) & (off <= body_len - nbytes) & (start <= size - nbytes)
        fast = ok & ~compressed & (nulls == 0) & (start % isz == 0)
        self.lengths[idx] = np.where(ok, length, -1)
        self.starts[idx] = np.where(fast, start // isz, 0)
        self.fast[idx] = fast
        self.parsed[idx] = True

    def _parse_flatbuffers(self, u8: _Bytes, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Read each batch's ``Message`` -> ``RecordBatch`` flatbuffer, vectorised over ``idx``;
        returns the positions found (for :meth:`_make_template`)."""
        size = u8.size
        node, buffer = self._node, self._buffer
        m = self._offset[idx]
        ok = (m >= 8) & (m < size)
        marker, ok1 = _gather(u8, m, "<u4")
        ok &= ok1
        fb = m + np.where(marker == 0xFFFFFFFF, 8, 4)  # after the continuation marker, length
        msg, ok = _deref(u8, fb, ok)
        pos, present, ok = _field(u8, msg, 1, ok)  # Message.header_type
        htype, ok1 = _gather(u8, pos, "<u1")
        ok &= present & ok1 & (htype == _RECORD_BATCH)
        body_length_at, _, ok = _field(u8, msg, 3, ok)  # Message.bodyLength
        pos, present, ok = _field(u8, msg, 2, ok)  # Message.header
        ok &= present
        rb, ok = _deref(u8, pos, ok)
        length_at, _, ok = _field(u8, rb, 0, ok)  # RecordBatch.length
        _, compressed, ok = _field(u8, rb, 3, ok)  # RecordBatch.compression
        pos, present, ok = _field(u8, rb, 1, ok)  # RecordBatch.nodes
        ok &= present
        nodes, ok = _deref(u8, pos, ok)
        n_nodes, ok1 = _gather(u8, nodes, "<u4")
        ok &= ok1 & (n_nodes > node)
        length, ok1 = _gather(u8, nodes + 4 + 16 * node, "<i8")  # FieldNode.length
        nulls, ok2 = _gather(u8, nodes + 12 + 16 * node, "<i8")  # FieldNode.null_count
        ok &= ok1 & ok2 & (length >= 0)
        pos, present, ok = _field(u8, rb, 2, ok)  # RecordBatch.buffers
        ok &= present
        bufs, ok = _deref(u8, pos, ok)
        n_bufs, ok1 = _gather(u8, bufs, "<u4")
        ok &= ok1 & (n_bufs > buffer + 1)
        data = bufs + 4 + 16 * (buffer + 1)  # the values Buffer, after the validity bitmap
        off, ok1 = _gather(u8, data, "<i8")
        blen, ok2 = _gather(u8, data + 8, "<i8")
        ok &= ok1 & ok2
        self._store(size, idx, ok, length, nulls, off, blen, compressed)
        return {
            "ok": ok,
            "compressed": compressed,
            "nodes": nodes,
            "n_nodes": n_nodes,
            "bufs": bufs,
            "n_bufs": n_bufs,
            "length_at": length_at,
            "body_length_at": body_length_at,
        }


class _Bytes:
    """A file's bytes with one little-endian view per scalar type, for aligned gathers."""

    def __init__(self, buf: Any) -> None:
        self.u8 = np.frombuffer(buf, np.uint8)
        self.size = int(self.u8.size)
        self._views: dict[str, np.ndarray] = {}

    def view(self, dt: str) -> np.ndarray:
        v = self._views.get(dt)
        if v is None:
            width = np.dtype(dt).itemsize
            v = self._views[dt] = self.u8[: self.size - self.size % width].view(dt)
        return v


def _gather(data: _Bytes, pos: np.ndarray, dt: str) -> tuple[np.ndarray, np.ndarray]:
    """Values of type ``dt`` at byte positions ``pos``, and which could be read (in bounds and
    aligned to their size, as flatbuffers lays scalars out in Arrow's 8-aligned messages)."""
    width = np.dtype(dt).itemsize
    ok = (pos >= 0) & (pos <= data.size - width) & (pos % width == 0)
    at = np.where(ok, pos // width, 0)
    view = data.view(dt)
    if not len(view):
        return np.zeros(len(pos), np.int64), np.zeros(len(pos), bool)
    return view[at].astype(np.int64), ok


def _field(
    u8: _Bytes, table: np.ndarray, k: int, ok: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Field ``k`` of the flatbuffer tables at ``table``: its byte position, whether it is
    present (absent fields take their default), and whether the lookup was in bounds."""
    soff, ok1 = _gather(u8, table, "<i4")
    vtable = table - soff
    vt_size, ok2 = _gather(u8, vtable, "<u2")
    entry = 4 + 2 * k
    inside = vt_size > entry
    fo, ok3 = _gather(u8, vtable + entry, "<u2")
    valid = ok & ok1 & ok2 & (ok3 | ~inside)
    present = valid & inside & ok3 & (fo > 0)
    return np.where(present, table + fo, -1), present, valid


def _deref(u8: _Bytes, pos: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Follow the flatbuffer ``uoffset`` stored at ``pos``."""
    rel, ok1 = _gather(u8, pos, "<u4")
    return pos + rel, ok & ok1


def batch_index(buf: Any, schema: pa.Schema, col_index: int) -> BatchIndex | None:
    """The :class:`BatchIndex` of column ``col_index`` (an integer column) of the Arrow IPC
    file in ``buf``, from its footer (batches are parsed on demand, see
    :meth:`BatchIndex.ensure`).

    Returns None when the file is not one this index models (not the IPC file format, a big-
    endian file or host, an unreadable footer, or a column preceded by nested columns); the
    caller then reads through pyarrow. Batches with a null, compression or an unexpected
    layout are marked not ``fast``.
    """
    if sys.byteorder != "little":
        return None
    t = schema.field(col_index).type
    if not pa.types.is_integer(t):
        return None
    node, buffer = col_index, 0
    for k in range(col_index):
        nb = _flat_buffers(schema.field(k).type)
        if nb is None:
            return None
        buffer += nb
    dtype = np.dtype(t.to_pandas_dtype()).newbyteorder("<")
    u8 = _Bytes(buf)
    size = u8.size
    if size < 18 or bytes(u8.u8[:6]) != _MAGIC or bytes(u8.u8[-6:]) != _MAGIC:
        return None
    one = np.ones(1, bool)
    footer = np.array([size - 10 - int(u8.u8[size - 10 : size - 6].view("<i4")[0])])
    if footer[0] < 8:
        return None
    root, ok = _deref(u8, footer, one)
    # Footer.schema (field 1) -> Schema.endianness (field 0; 0 = little, the default)
    pos, present, ok = _field(u8, root, 1, ok)
    if present[0]:
        sch, ok = _deref(u8, pos, ok)
        pos, present, ok = _field(u8, sch, 0, ok)
        if present[0]:
            endian, ok1 = _gather(u8, pos, "<i2")
            if not ok1[0] or endian[0] != 0:
                return None
    if not ok[0]:
        return None
    # Footer.recordBatches (field 3): a vector of Block structs
    pos, present, ok = _field(u8, root, 3, ok)
    if not ok[0]:
        return None
    if not present[0]:
        blocks = np.zeros(0, _BLOCK)
    else:
        vec, ok = _deref(u8, pos, ok)
        count, ok1 = _gather(u8, vec, "<u4")
        n = int(count[0])
        if not (ok[0] and ok1[0]) or int(vec[0]) + 4 + n * _BLOCK.itemsize > size:
            return None
        blocks = np.frombuffer(buf, _BLOCK, count=n, offset=int(vec[0]) + 4)
    return BatchIndex(dtype, blocks, node, buffer, size, bytes(u8.u8[-10:]))


def _index_agrees(index: BatchIndex, buf: Any, file_reader: Any, col_index: int) -> bool:
    """Whether pyarrow finds the first and the last non-empty fast batch among the first and
    the last few batches where ``index`` says."""
    n = len(index)
    ends = np.unique(np.concatenate([np.arange(min(n, 8)), np.arange(max(n - 8, 0), n)]))
    index.ensure(buf, ends)
    fast = ends[index.fast[ends] & (index.lengths[ends] > 0)]
    if not len(fast):
        return True
    base = pa.py_buffer(buf).address
    for i in {int(fast[0]), int(fast[-1])}:
        column = file_reader.get_batch(i).column(col_index)
        address = column.buffers()[1].address + column.offset * index.dtype.itemsize
        if (
            len(column) != index.lengths[i]
            or address != base + index.starts[i] * index.dtype.itemsize
        ):
            return False
    return True


def _local_path(url: str, storage_options: dict[str, Any]) -> str | None:
    """The local path of ``url`` (None for other filesystems)."""
    if "://" not in url and "::" not in url:
        return url  # a plain path: fsspec's local filesystem
    try:
        fs, path = filesystem(url, storage_options)
    except ValueError:
        return None
    return str(path) if is_local(fs) else None


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
        self._index_cache: OrderedDict[tuple[Any, ...], tuple[pa.Schema, int, BatchIndex]] = (
            OrderedDict()
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_index_cache"] = OrderedDict()  # per process, never pickled
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._index_cache = OrderedDict()

    def open(self, url: str) -> ArrowReader:
        path = _local_path(url, self.storage_options)
        if path is not None and self._index_cache:
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
                hit = self._index_cache.get(_stat_key(path, st))
                if hit is None or st.st_size == 0:
                    return None
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None  # read_source reports it
        schema, col_index, index = hit
        if len(buf) != index.size or buf[-10:] != index.tail:
            return None
        self._index_cache.move_to_end(_stat_key(path, st))
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
            if not _index_agrees(index, buf, file_reader, col_index):
                return None
        except (pa.ArrowException, OSError, ValueError, IndexError):
            return None  # pyarrow reports the problem when the batch is read
        if key is not None:
            for old in [k for k in self._index_cache if k[0] == key[0]]:
                del self._index_cache[old]  # an earlier version of the file
            self._index_cache[key] = (schema, col_index, index)
            while len(self._index_cache) > 1 and (
                len(self._index_cache) > _INDEX_CACHE_FILES
                or sum(len(ix) for _, _, ix in self._index_cache.values()) > _INDEX_CACHE_BATCHES
            ):
                self._index_cache.popitem(last=False)
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
