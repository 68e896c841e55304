"""Mosaic MDS shards (the format of ``mosaicml-streaming``, in which CEPED stores its samples).

An MDS dataset is a folder holding ``index.json`` and shard files ``shard.NNNNN.mds`` (or,
compressed, ``shard.NNNNN.mds.zstd`` / ``.gz`` / ``.bz2``). A shard file describes itself, so
the unit this handler reads is one shard file and ``index.json`` is not needed to read it::

    uint32 n                      samples in the shard
    uint32 offsets[n + 1]         byte position of each sample in the file, then the file's end
    config                        JSON: column_names, column_encodings, column_sizes, ...
    samples                       each: a uint32 size per variable-size column (in column
                                  order), then every column's bytes, in column order

Columns are sorted by name; a column with a fixed size (``column_sizes[i]`` not null, e.g.
``int``, ``uint32``, ``ndarray:uint16:128``) has no size entry. The document is column
``col_name``:

* ``ndarray`` encodings (``ndarray``, ``ndarray:uint32``, ``ndarray:int64:2048``) with an
  integer dtype give tokens: zero-copy NumPy views of the (memory-mapped) shard. A dynamic
  dtype is one byte before the values, a dynamic shape one byte ``ndim << 2 | k`` then ``ndim``
  ``uint{8 << k}`` dimensions; a multi-dimensional array is read flattened;
* ``str`` gives text (UTF-8);
* ``bytes`` gives tokens of ``bytes_dtype`` (LLM Foundry's older ``concat_tokens`` shards hold
  ``int64`` tokens as ``bytes``), or text with ``bytes_dtype="text"``.

Other columns (``int``, scalars, ``json``, images, ...) are skipped over by their sizes.
Everything is little-endian. The sample sizes and column positions of a shard are found with
NumPy at ``open``, for all samples at once.

:mod:`torchdata_ext.handlers.mds_writer` writes the format.
"""

from __future__ import annotations

import bz2
import json
import posixpath
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from torchdata_ext.handlers.base import DataFileError, FileHandler
from torchdata_ext.handlers.jsonl import gunzip, unzstd
from torchdata_ext.handlers.numpy_tokens import Source, check_index, check_indices, read_source

__all__ = [
    "INDEX_FILE",
    "MDS_SUFFIXES",
    "MdsHandler",
    "MdsReader",
    "drop_mds_side_files",
]

INDEX_FILE = "index.json"
MDS_SUFFIXES = (".mds", ".mds.zstd", ".mds.zst", ".mds.gz", ".mds.bz2")
# the ndarray encoding's dtype codes (a byte before the values when the dtype is not fixed)
_DTYPE_CODES = {
    8: "uint8",
    9: "int8",
    16: "uint16",
    17: "int16",
    18: "float16",
    32: "uint32",
    33: "int32",
    34: "float32",
    64: "uint64",
    65: "int64",
    66: "float64",
}
CODE_OF = {v: k for k, v in _DTYPE_CODES.items()}
SCALARS = {"int": "int64", **{d: d for d in _DTYPE_CODES.values()}}  # fixed-size encodings


def _u32_at(u8: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The little-endian uint32 at each byte position ``pos`` (unaligned), as int64."""
    b = u8[pos[:, None] + np.arange(4)].astype(np.int64)
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


class MdsReader:
    """An opened MDS shard file.

    Attributes:
        url: the shard file.
        data: its (decompressed) bytes, or the memory map of a raw local shard.
        starts: int64 byte position of each sample's document values.
        lengths: int64 length of each document (tokens, or bytes of UTF-8 text).
        dtype: the token dtype (None for text).
        produces: ``"tokens"`` or ``"text"``.
        columns: ``{name: encoding}`` of the shard.
    """

    def __init__(
        self,
        url: str,
        data: Source,
        starts: np.ndarray,
        lengths: np.ndarray,
        dtype: np.dtype | None,
        columns: dict[str, str],
    ) -> None:
        self.url = url
        self.data = data
        self.starts = starts
        self.lengths = lengths
        self.dtype = dtype
        self.produces = "text" if dtype is None else "tokens"
        self.columns = columns

    def __len__(self) -> int:
        return int(self.starts.size)

    def close(self) -> None:
        self.data = b""
        self.starts = self.lengths = np.zeros(0, np.int64)

    def __repr__(self) -> str:
        return f"MdsReader({self.url!r}, docs={len(self)}, {self.produces})"


class MdsHandler(FileHandler):
    """Mosaic MDS shard files; one document per sample, in column ``col_name``.

    Args:
        col_name: the column holding each document: an integer ``ndarray`` column (tokens),
            a ``str`` column (text), or a ``bytes`` column (see ``bytes_dtype``).
        storage_options: fsspec keyword arguments.
        bytes_dtype: how a ``bytes`` column is read: a NumPy integer dtype name (``"int64"``
            for LLM Foundry's token bytes, ``"uint32"``, ...) or ``"text"`` (UTF-8); None
            refuses a ``bytes`` column, asking for it.

    ``doc_lengths`` gives token counts for token columns and None for text.
    """

    name: ClassVar[str] = "mds"
    suffixes: ClassVar[tuple[str, ...]] = MDS_SUFFIXES
    produces: ClassVar[str] = "tokens"

    def __init__(
        self,
        col_name: str = "tokens",
        storage_options: dict[str, Any] | None = None,
        bytes_dtype: str | None = None,
    ) -> None:
        super().__init__(col_name, storage_options)
        if bytes_dtype is not None and bytes_dtype != "text":
            try:
                kind: str = np.dtype(bytes_dtype).kind
            except TypeError:
                kind = "?"
            if kind not in ("i", "u"):
                raise ValueError(
                    f"{bytes_dtype=} must be an integer dtype name such as 'int64' or 'uint32', "
                    "or 'text'"
                )
        self.bytes_dtype = bytes_dtype

    def open(self, url: str) -> MdsReader:
        raw = read_source(url, self.storage_options)
        data = _decompress(url, raw)
        n, offsets, config = _header(url, data)
        columns = _columns(url, config)
        if self.col_name not in columns:
            raise DataFileError(
                url,
                f"no column {self.col_name!r}; its columns are {columns}; pass col_name=... "
                "naming the token (ndarray) or text (str) column",
            )
        u8 = np.frombuffer(data, np.uint8)
        starts, lengths = _locate(url, u8, offsets, config, self.col_name)
        encoding = columns[self.col_name]
        dtype = self._dtype(url, u8, encoding, starts, lengths)
        if encoding.split(":")[0] == "ndarray":
            starts, lengths = _skip_array_header(url, u8, encoding, starts, lengths)
        if dtype is not None:
            size = dtype.itemsize
            if (lengths % size).any():
                bad = int(np.flatnonzero(lengths % size)[0])
                raise DataFileError(
                    url,
                    f"sample {bad}: column {self.col_name!r} holds {int(lengths[bad])} bytes, "
                    f"not a whole number of {dtype.name} values; check bytes_dtype",
                )
            lengths = lengths // size
        return MdsReader(url, data, starts, lengths, dtype, columns)

    def _dtype(
        self, url: str, u8: np.ndarray, encoding: str, starts: np.ndarray, lengths: np.ndarray
    ) -> np.dtype | None:
        """The token dtype of column ``col_name`` (None: text); refuses other columns."""
        kind, _, rest = encoding.partition(":")
        if kind == "str":
            return None
        if kind == "bytes":
            if self.bytes_dtype is None:
                raise DataFileError(
                    url,
                    f"column {self.col_name!r} holds raw bytes: pass bytes_dtype='int64' (or the "
                    "token dtype its writer used, e.g. 'uint32'), or bytes_dtype='text' for UTF-8",
                )
            return None if self.bytes_dtype == "text" else np.dtype(self.bytes_dtype)
        if kind == "ndarray":
            name = rest.split(":")[0]
            if not name:  # a dtype byte before each sample's values
                codes = np.unique(u8[starts[lengths > 0]]) if starts.size else np.zeros(0)
                names = {_DTYPE_CODES.get(int(c), f"code {int(c)}") for c in codes}
                if len(names) > 1:
                    raise DataFileError(
                        url, f"column {self.col_name!r} mixes dtypes {sorted(names)}"
                    )
                name = names.pop() if names else "int64"
            if name not in CODE_OF or np.dtype(name).kind not in "iu":
                raise DataFileError(
                    url,
                    f"column {self.col_name!r} holds {name} arrays, not integer token ids; pass "
                    "col_name=... naming the token column",
                )
            return np.dtype(name).newbyteorder("<")
        raise DataFileError(
            url,
            f"column {self.col_name!r} has encoding {encoding!r}, which holds no document; "
            "pass col_name=... naming an ndarray (tokens), str (text) or bytes column",
        )

    def produces_for(self, reader: MdsReader) -> str:
        return reader.produces

    def length(self, reader: MdsReader) -> int:
        return int(reader.starts.size)

    def get(self, reader: MdsReader, index: int) -> np.ndarray | str:
        i = check_index(reader.url, index, int(reader.starts.size))
        start, n = int(reader.starts[i]), int(reader.lengths[i])
        if reader.dtype is not None:
            return np.frombuffer(reader.data, reader.dtype, count=n, offset=start)
        try:
            return bytes(reader.data[start : start + n]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataFileError(
                reader.url, f"sample {i}: column {self.col_name!r} is not valid UTF-8 ({exc})"
            ) from exc

    def get_many(
        self, reader: MdsReader, indices: Sequence[int] | np.ndarray
    ) -> list[np.ndarray | str]:
        idx = check_indices(reader.url, indices, int(reader.starts.size))
        if reader.dtype is None:
            return [self.get(reader, i) for i in idx.tolist()]
        data, dtype = reader.data, reader.dtype
        return [
            np.frombuffer(data, dtype, count=n, offset=s)
            for s, n in zip(reader.starts[idx].tolist(), reader.lengths[idx].tolist())
        ]

    def doc_lengths(self, reader: MdsReader) -> np.ndarray | None:
        return None if reader.dtype is None else reader.lengths.copy()

    def close(self, reader: MdsReader) -> None:
        reader.close()


# -- reading ---------------------------------------------------------------------------------------
def _decompress(url: str, raw: Source) -> Source:
    """A shard's raw bytes: decompressed as its name says (``.zstd``/``.zst``/``.gz``/``.bz2``)."""
    name = url.lower()
    if name.endswith((".zstd", ".zst")):
        return unzstd(url, raw)
    if name.endswith(".gz"):
        return gunzip(url, raw)
    if name.endswith(".bz2"):
        try:
            return bz2.decompress(raw)
        except (OSError, ValueError, EOFError) as exc:
            raise DataFileError(url, f"bz2 data is truncated or corrupt ({exc})") from exc
    return raw


def _header(url: str, data: Source) -> tuple[int, np.ndarray, dict[str, Any]]:
    """``(n, offsets as int64, config)`` of a raw shard, checked against its size."""
    size = len(data)
    if size < 8:
        raise DataFileError(url, f"{size} bytes: too short for an MDS shard (truncated?)")
    n = int(np.frombuffer(data, "<u4", count=1)[0])
    if 4 + 4 * (n + 1) > size:
        raise DataFileError(
            url, f"header says {n} samples but the file has only {size} bytes (truncated?)"
        )
    offsets = np.frombuffer(data, "<u4", count=n + 1, offset=4).astype(np.int64)
    head = 4 + 4 * (n + 1)
    if offsets[0] < head or (np.diff(offsets) < 0).any() or offsets[-1] > size:
        raise DataFileError(
            url,
            f"sample offsets are out of order or past the end of the file ({size} bytes; "
            f"last offset {int(offsets[-1])}): the shard is truncated or not MDS",
        )
    try:
        config = json.loads(bytes(data[head : int(offsets[0])]))
    except ValueError as exc:
        raise DataFileError(url, f"the shard's config is not valid JSON ({exc})") from exc
    if not isinstance(config, dict) or config.get("format", "mds") != "mds":
        raise DataFileError(url, f"not an MDS shard (config {str(config)[:200]})")
    return n, offsets, config


def _columns(url: str, config: dict[str, Any]) -> dict[str, str]:
    try:
        names, encodings, sizes = (
            config["column_names"],
            config["column_encodings"],
            config["column_sizes"],
        )
    except KeyError as exc:
        raise DataFileError(url, f"the shard's config has no {exc.args[0]!r}") from None
    if not len(names) == len(encodings) == len(sizes):
        raise DataFileError(url, "column_names, column_encodings and column_sizes differ in length")
    return dict(zip(names, encodings))


def _locate(
    url: str, u8: np.ndarray, offsets: np.ndarray, config: dict[str, Any], col: str
) -> tuple[np.ndarray, np.ndarray]:
    """Byte position and byte length of column ``col`` in every sample, vectorised."""
    names, sizes = config["column_names"], config["column_sizes"]
    starts, ends = offsets[:-1], offsets[1:]
    var = [k for k, s in enumerate(sizes) if s is None]
    if ((ends - starts) < 4 * len(var)).any():
        raise DataFileError(url, "a sample is shorter than its size table (corrupt shard)")

    def size_of(k: int) -> np.ndarray | int:
        fixed = sizes[k]
        return int(fixed) if fixed is not None else _u32_at(u8, starts + 4 * var.index(k))

    j = names.index(col)
    pos = starts + 4 * len(var)
    for k in range(j):
        pos = pos + size_of(k)
    length = np.broadcast_to(np.asarray(size_of(j), np.int64), pos.shape).copy()
    bad = np.flatnonzero(pos + length > ends)
    if bad.size:
        raise DataFileError(
            url, f"sample {int(bad[0])}: column {col!r} runs past the sample's end (corrupt shard)"
        )
    return pos.astype(np.int64), length


def _skip_array_header(
    url: str, u8: np.ndarray, encoding: str, starts: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Positions and byte lengths of the values of ``ndarray`` column samples (after the dtype
    byte and the shape, where the encoding does not fix them)."""
    parts = encoding.split(":")
    fixed_dtype = len(parts) > 1 and parts[1] != ""
    fixed_shape = len(parts) > 2 and parts[2] != ""
    head = np.zeros_like(starts)
    if not fixed_dtype:
        head += 1
    if not fixed_shape:
        if (lengths < head + 1).any():
            raise DataFileError(url, "an ndarray sample has no shape byte (corrupt shard)")
        byte = u8[starts + head].astype(np.int64)
        head += 1 + (byte >> 2) * (1 << (byte & 3))
    if (head > lengths).any():
        raise DataFileError(url, "an ndarray sample is shorter than its shape (corrupt shard)")
    return starts + head, lengths - head


# -- listing ---------------------------------------------------------------------------------------
def drop_mds_side_files(files: Sequence[str]) -> list[str]:
    """``files`` without what is not MDS data when MDS shards are listed: ``index.json`` next
    to shards, and a compressed shard whose raw copy is listed too (a streaming cache keeps
    both)."""
    shards = [f for f in files if f.lower().endswith(MDS_SUFFIXES)]
    if not shards:
        return list(files)
    folders = {posixpath.dirname(f) for f in shards}
    listed = set(files)
    out = []
    for f in files:
        if posixpath.basename(f) == INDEX_FILE and posixpath.dirname(f) in folders:
            continue
        raw = f[: f.lower().rfind(".mds") + 4]
        if f.lower().endswith(MDS_SUFFIXES[1:]) and raw in listed:
            continue
        out.append(f)
    return out
