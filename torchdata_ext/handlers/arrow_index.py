"""The fast metadata index of Arrow IPC files in the Bamba layout (one document per record
batch): where each record batch's token buffer is, parsed with NumPy from the file's footer
and the batches' flatbuffer metadata, so :class:`~torchdata_ext.handlers.arrow.ArrowHandler`
serves ``get`` / ``get_many`` as slices of one view of the file. Pure parsing, no I/O beyond
the buffer it is given.
"""

from __future__ import annotations

import sys
from typing import Any, Literal, NamedTuple

import numpy as np
import pyarrow as pa

__all__ = ["BatchIndex", "batch_index", "index_agrees"]

_PARSE_GROUP = 64  # batches parsed together when only a few are asked for

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
            base = sorted_unique(todo // _PARSE_GROUP) * _PARSE_GROUP
            todo = (base[:, None] + np.arange(_PARSE_GROUP)).ravel()
            todo = todo[todo < len(self.parsed)]
            todo = todo[~self.parsed[todo]]
        self._parse(_Bytes(buf), sorted_unique(todo))

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


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """The distinct values of the 1-D integer array ``a``, sorted: ``np.unique(a)`` without its
    checks, which import ``numpy.ma`` on first use (~10 ms of a worker's first batch)."""
    a = np.sort(a)
    if a.size > 1:
        keep = np.empty(a.size, bool)
        keep[0] = True
        np.not_equal(a[1:], a[:-1], out=keep[1:])
        a = a[keep]
    return a


def index_agrees(index: BatchIndex, buf: Any, file_reader: Any, col_index: int) -> bool:
    """Whether pyarrow finds the first and the last non-empty fast batch among the first and
    the last few batches where ``index`` says."""
    n = len(index)
    ends = np.array(sorted({*range(min(n, 8)), *range(max(n - 8, 0), n)}), np.int64)
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
