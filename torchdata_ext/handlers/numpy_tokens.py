"""Token files stored as NumPy arrays: CEPED ``.npy``, flat token streams (``.bin``/``.npy``).

Three formats live here:

* ``ceped`` (:class:`CepedHandler`): one 1-D integer ``.npy`` array laid out as
  ``[n] [len(d1) .. len(dn)] [d1] .. [dn]`` (the CEPED RedPajama preprocessing).
* ``flat`` (:class:`FlatTokenHandler`): all documents concatenated into one token array, either
  a raw little-endian ``.bin`` file (``uint32`` unless ``dtype=...``) or a 1-D ``.npy`` (the
  Bolmo / OLMo layout). Document boundaries come from an offsets sidecar
  ``<url>.offsets.npy`` (``int64``, ``n + 1`` non-decreasing offsets from 0 to the token count;
  it wins when present) or from splitting after every ``eos_token``.
* ``npy`` (:class:`NpyHandler`): sniffs a ``.npy`` file. A file with an offsets sidecar is flat;
  otherwise a 1-D integer array that passes the CEPED validation *exactly*
  (``n >= 0``, lengths non-negative, ``1 + n + sum(lengths) == size``) is CEPED; anything else
  is flat. A flat token stream can pass the CEPED check by accident (e.g. ``[0]`` or
  ``[2, 1, 0, 7]``), so write an offsets sidecar or pass ``file_type="flat"``/``"ceped"`` when
  the format is known.

Local files are memory-mapped and every document is a read-only zero-copy view of the map.
Files on object stores are read by range when their layout says where documents are without
reading the tokens (a CEPED header, an offsets sidecar): the header and the index when opened,
then each document's bytes when it is read (``open_ranged``; a 10 GB shard gives its first
documents after a few requests). A flat file split on ``eos_token`` has to be read whole, as
are ``memory://`` files (viewed with ``np.frombuffer``).

This module also holds the small helpers the other handlers share (:func:`read_source`,
:func:`check_index`, :func:`check_indices`) and the base of the token-array handlers
(:class:`TokenArrayHandler`, which the Megatron handler extends). This module is 658 lines
because the three layouts share one reader and one opening by range.
"""

from __future__ import annotations

import io
import mmap
import operator
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from torchdata_ext.handlers.base import DataFileError, FileHandler
from torchdata_ext.handlers.ranged import (
    ByteRanges,
    FsRanges,
    OpenRanges,
    RangedTokens,
    read_exact,
    reads_by_range,
)
from torchdata_ext.remote.urls import filesystem, is_local

__all__ = [
    "CepedHandler",
    "FlatTokenHandler",
    "NpyHandler",
    "TokenArrayHandler",
    "TokenArrayReader",
]

NPY_MAGIC = b"\x93NUMPY"
OFFSETS_SUFFIX = ".offsets.npy"
# tokens compared against eos_token per step, bounding the temporary boolean mask
_EOS_CHUNK = 1 << 24

Source = Any  # bytes, or an mmap.mmap for local files: anything with the buffer protocol


# --------------------------------------------------------------------------- shared helpers
def read_source(url: str, storage_options: dict[str, Any] | None = None) -> Source:
    """The bytes of ``url``: a read-only ``mmap`` for local files, ``fs.cat_file`` otherwise.

    An empty local file gives ``b""`` (it cannot be mapped).

    Raises:
        DataFileError: the file is missing, is a directory, or cannot be read.
    """
    fs, path = filesystem(url, storage_options)
    try:
        if is_local(fs):
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return b""
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return fs.cat_file(path)
    except FileNotFoundError:
        raise DataFileError(
            url, "file not found; check the path (and storage_options for a remote filesystem)"
        ) from None
    except IsADirectoryError:
        raise DataFileError(
            url, "is a directory, not a data file; pass file URLs (or a glob such as dir/*.arrow)"
        ) from None
    except OSError as exc:
        raise DataFileError(
            url, f"cannot read the file ({exc}); check permissions and storage_options"
        ) from exc


def source_exists(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``url`` names an existing file."""
    fs, path = filesystem(url, storage_options)
    return bool(fs.isfile(path))


def check_index(url: str, index: Any, n: int) -> int:
    """``index`` as an ``int`` in ``[0, n)``; IndexError naming ``url`` otherwise."""
    i = operator.index(index)
    if not 0 <= i < n:
        raise IndexError(f"document index {i} out of range [0, {n}) in {url}")
    return i


def check_indices(url: str, indices: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """``indices`` as an int64 array, each in ``[0, n)``; IndexError naming ``url`` otherwise."""
    arr = np.asarray(indices)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"document indices must be integers, got dtype {arr.dtype} for {url}")
    arr = arr.reshape(-1).astype(np.int64, copy=False)
    bad = np.flatnonzero((arr < 0) | (arr >= n))
    if bad.size:
        raise IndexError(f"document index {int(arr[bad[0]])} out of range [0, {n}) in {url}")
    return arr


def npy_layout(
    url: str, read: Callable[[int, int], bytes], size: int
) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """``(dtype, shape, fortran_order, data_offset)`` of the ``.npy`` file of ``size`` bytes
    whose bytes ``read(start, end)`` returns (a buffer's slice, or a range request).

    Raises:
        DataFileError: not a ``.npy`` file, a corrupt or truncated header, object dtype, or
            fewer data bytes than the header declares.
    """
    head = read(0, min(size, 12))
    if head[:6] != NPY_MAGIC:
        raise DataFileError(
            url,
            "not a NumPy .npy file (no \\x93NUMPY magic at the start); check the file, or for a "
            "raw token stream use file_type='flat' with a .bin name and dtype=...",
        )
    major = head[6] if size > 6 else 0
    if major == 1:
        len_size = 2
    elif major in (2, 3):
        len_size = 4
    else:
        raise DataFileError(
            url,
            f".npy format version {major} is not supported or the file is corrupt; re-save it with numpy.save",
        )
    if size < 8 + len_size:
        raise DataFileError(url, "the .npy header is truncated; re-create or re-download the file")
    header_len = int.from_bytes(head[8 : 8 + len_size], "little")
    data_offset = 8 + len_size + header_len
    if data_offset > size:
        raise DataFileError(url, "the .npy header is truncated; re-create or re-download the file")
    header = io.BytesIO(read(0, data_offset))
    try:
        np.lib.format.read_magic(header)
        if major == 1:
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(header)
        else:
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(header)
    except (ValueError, SyntaxError) as exc:
        raise DataFileError(
            url, f"corrupt .npy header ({exc}); re-create the file with numpy.save"
        ) from exc
    if dtype.hasobject:
        raise DataFileError(
            url, f"the .npy array has object dtype {dtype}; token files need an integer dtype"
        )
    count = int(np.prod(shape, dtype=np.int64))
    need = count * dtype.itemsize
    if size - data_offset < need:
        raise DataFileError(
            url,
            f"truncated: the .npy header declares {count} items of {dtype} ({need} bytes) but "
            f"only {size - data_offset} bytes follow; re-create or re-download the file",
        )
    return dtype, tuple(shape), bool(fortran_order), data_offset


def parse_npy(url: str, buf: Source) -> np.ndarray:
    """View the ``.npy`` file held in ``buf`` as an array, zero-copy.

    Raises:
        DataFileError: not a ``.npy`` file, a corrupt header, object dtype, or truncated data.
    """
    dtype, shape, fortran_order, data_offset = npy_layout(
        url, lambda a, b: bytes(buf[a:b]), len(buf)
    )
    count = int(np.prod(shape, dtype=np.int64))
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=data_offset)
    if fortran_order and len(shape) > 1:
        return arr.reshape(shape[::-1]).T
    return arr.reshape(shape)


def _load_offsets(url: str, buf: Source, n_tokens: int) -> np.ndarray:
    """Validate an offsets sidecar: 1-D integer, starts at 0, non-decreasing, ends at n_tokens."""
    raw = parse_npy(url, buf)
    fix = "re-write the offsets file (n + 1 int64 offsets from 0 to the token count) or delete it and pass eos_token=..."
    if raw.ndim != 1 or raw.dtype.kind not in "iu":
        raise DataFileError(
            url,
            f"offsets sidecar must be a 1-D integer array, got shape {raw.shape} dtype {raw.dtype}; {fix}",
        )
    if raw.size == 0:
        raise DataFileError(url, f"offsets sidecar is empty (it needs at least [0]); {fix}")
    offsets = np.array(raw, dtype=np.int64)
    if offsets[0] != 0 or offsets[-1] != n_tokens:
        raise DataFileError(
            url,
            f"offsets run from {int(offsets[0])} to {int(offsets[-1])} but must run from 0 to "
            f"the token count {n_tokens}; {fix}",
        )
    if offsets.size > 1 and bool((np.diff(offsets) < 0).any()):
        raise DataFileError(url, f"offsets are not non-decreasing; {fix}")
    return offsets


def ceped_offsets(arr: np.ndarray | RangedTokens) -> np.ndarray | str:
    """Document offsets of a CEPED array, or the reason it is not one.

    A CEPED array is 1-D integer ``[n] [len(d1) .. len(dn)] [d1] .. [dn]`` with ``n >= 0``,
    non-negative lengths and ``1 + n + sum(lengths) == arr.size``. The returned offsets
    (int64, ``n + 1`` values) index into ``arr`` itself. Reads ``arr[:1 + n]`` only (two range
    requests for a :class:`~torchdata_ext.handlers.ranged.RangedTokens`).
    """
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        return f"not a 1-D integer array (shape {arr.shape}, dtype {arr.dtype})"
    size = int(arr.size)
    if size == 0:
        return "the array is empty (a CEPED array starts with the document count n)"
    n = int(arr[:1][0])
    if n < 0 or 1 + n > size:
        return f"the first value n={n} is not a valid document count for an array of {size} values"
    lengths = np.array(arr[1 : 1 + n], dtype=np.int64)
    if n and (int(lengths.min()) < 0 or int(lengths.max()) > size):
        return "the document lengths after n are not all in [0, size]"
    total = 1 + n + int(lengths.sum())
    if total != size:
        return f"1 + n + sum(lengths) = {total} but the array holds {size} values"
    offsets = np.empty(n + 1, dtype=np.int64)
    offsets[0] = 0
    np.cumsum(lengths, out=offsets[1:])
    offsets += 1 + n
    return offsets


def eos_offsets(tokens: np.ndarray, eos_token: int) -> np.ndarray:
    """Offsets of the documents of ``tokens`` when each ends with ``eos_token`` (included).

    A trailing run without an EOS token is the last document. Vectorised (np.flatnonzero),
    scanning in chunks so the temporary mask stays small.
    """
    size = int(tokens.size)
    ends = [
        np.flatnonzero(tokens[s : s + _EOS_CHUNK] == eos_token) + (s + 1)
        for s in range(0, size, _EOS_CHUNK)
    ]
    parts = [np.zeros(1, dtype=np.int64), *(e.astype(np.int64, copy=False) for e in ends)]
    offsets = np.concatenate(parts)
    if offsets[-1] != size:
        offsets = np.append(offsets, np.int64(size))
    return offsets


# --------------------------------------------------------------------------- reader
class TokenArrayReader:
    """An opened CEPED or flat token file: document ``i`` is ``tokens[offsets[i]:offsets[i+1]]``.

    Attributes:
        url: the file.
        tokens: the token array (a zero-copy view of the memory map or of the fetched bytes),
            or a :class:`~torchdata_ext.handlers.ranged.RangedTokens` read by range when sliced.
        offsets: int64 document boundaries, ``length + 1`` values.
        kind: ``"ceped"``, ``"flat"``, ``"llmc"`` or ``"megatron"``.
        produces: always ``"tokens"``.
    """

    produces = "tokens"

    def __init__(
        self, url: str, tokens: np.ndarray | RangedTokens, offsets: np.ndarray, kind: str
    ) -> None:
        self.url = url
        self.tokens = tokens
        self.offsets = offsets
        self.kind = kind

    def __len__(self) -> int:
        return int(self.offsets.size) - 1

    def close(self) -> None:
        """Drop the references to the file's memory (views already handed out stay valid), and
        stop the range-read threads of a remote file."""
        if isinstance(self.tokens, RangedTokens):
            self.tokens.close()
        self.tokens = np.zeros(0, dtype=self.tokens.dtype)
        self.offsets = np.zeros(1, dtype=np.int64)

    def __enter__(self) -> TokenArrayReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TokenArrayReader({self.url!r}, kind={self.kind!r}, docs={len(self)})"


class TokenArrayHandler(FileHandler):
    """length / get / get_many / doc_lengths over a :class:`TokenArrayReader`."""

    produces: ClassVar[str] = "tokens"

    def produces_for(self, reader: TokenArrayReader) -> str:
        """What ``get`` returns for this reader: always ``"tokens"``."""
        return reader.produces

    def length(self, reader: TokenArrayReader) -> int:
        return int(reader.offsets.size) - 1

    def get(self, reader: TokenArrayReader, index: int) -> np.ndarray:
        offsets = reader.offsets
        i = check_index(reader.url, index, int(offsets.size) - 1)
        return reader.tokens[offsets[i] : offsets[i + 1]]

    def get_many(self, reader: TokenArrayReader, indices: Sequence[int] | np.ndarray) -> list[Any]:
        idx = check_indices(reader.url, indices, int(reader.offsets.size) - 1)
        tokens = reader.tokens
        starts = reader.offsets[idx].tolist()
        ends = reader.offsets[idx + 1].tolist()
        if isinstance(tokens, RangedTokens):  # range requests, several at once
            return tokens.take(starts, ends)
        return [tokens[s:e] for s, e in zip(starts, ends, strict=True)]

    def doc_lengths(self, reader: TokenArrayReader) -> np.ndarray:
        return np.diff(reader.offsets).astype(np.int64, copy=False)

    def close(self, reader: TokenArrayReader) -> None:
        reader.close()

    # -- opening helpers
    def _token_array(self, url: str, buf: Source, raw_dtype: np.dtype | None) -> np.ndarray:
        """The 1-D integer token array of a ``.npy`` file or (``raw_dtype``) a raw file."""
        if bytes(buf[:6]) == NPY_MAGIC or raw_dtype is None:
            arr = parse_npy(url, buf)
            _check_token_array(url, arr.shape, arr.dtype)
            return arr
        _check_raw_size(url, len(buf), raw_dtype)
        return np.frombuffer(buf, dtype=raw_dtype)

    def _open_remote(self, url: str) -> TokenArrayReader | None:
        """``url`` opened by range when it is on an object store (and its layout allows), else
        None (read whole, or memory-mapped when local)."""
        fs, _ = filesystem(url, self.storage_options)
        if not reads_by_range(fs):
            return None
        reader: TokenArrayReader | None = self.open_ranged(
            url, lambda u: FsRanges(u, self.storage_options)
        )
        return reader

    def _ranged_tokens(
        self, url: str, source: ByteRanges, raw_dtype: np.dtype | None, head: bytes = b""
    ) -> RangedTokens:
        """The token array of a remote ``.npy`` (its header read by range) or raw file;
        ``head``: the file's first bytes if already read (spares a request)."""
        if len(head) < min(source.size, 6):
            head = read_exact(source, 0, min(source.size, 6), "the file's first bytes")
        if head[:6] == NPY_MAGIC or raw_dtype is None:
            dtype, shape, _, offset = npy_layout(
                url, lambda a, b: read_exact(source, a, b, "the .npy header"), source.size
            )
            _check_token_array(url, shape, dtype)
            return RangedTokens(source, dtype, offset, shape[0])
        _check_raw_size(url, source.size, raw_dtype)
        return RangedTokens(source, raw_dtype, 0, source.size // raw_dtype.itemsize)

    def _ranged_sidecar(
        self, url: str, open_ranges: OpenRanges, n_tokens: int
    ) -> np.ndarray | None:
        """The offsets of the sidecar ``<url>.offsets.npy`` (read whole: 8 bytes a document),
        or None when there is none."""
        sidecar = url + OFFSETS_SUFFIX
        try:
            source = open_ranges(sidecar)
        except (FileNotFoundError, DataFileError):
            return None
        return _load_offsets(sidecar, read_exact(source, 0, source.size, "the offsets"), n_tokens)

    def _flat_offsets(
        self, url: str, tokens: np.ndarray, eos_token: int | None, reason: str = ""
    ) -> np.ndarray:
        """Offsets from the ``<url>.offsets.npy`` sidecar if present, else from ``eos_token``."""
        sidecar = url + OFFSETS_SUFFIX
        if source_exists(sidecar, self.storage_options):
            return _load_offsets(sidecar, read_source(sidecar, self.storage_options), tokens.size)
        if eos_token is None:
            raise DataFileError(
                url,
                (f"{reason}; " if reason else "")
                + "a flat token file needs document boundaries but there is no offsets sidecar "
                f"{sidecar.rsplit('/', 1)[-1]!r} and no eos_token; pass eos_token=... (documents "
                "end with it) or write the offsets file (see torchdata_ext.testing.write_flat_tokens)",
            )
        info = np.iinfo(tokens.dtype)
        if not info.min <= eos_token <= info.max:
            raise DataFileError(
                url,
                f"eos_token={eos_token} cannot occur in a {tokens.dtype} token array; "
                "pass the right eos_token (or dtype=... for raw files)",
            )
        return eos_offsets(tokens, eos_token)


LLMC_HEADER_BYTES = 256 * 4
LLMC_VERSIONS: dict[tuple[int, int], np.dtype] = {
    (20240520, 1): np.dtype("<u2"),
    (20240801, 7): np.dtype("<u4"),
}
"""llm.c token shards' ``(magic, version)`` -> token dtype (its ``HEADERS_INFO``)."""


def llmc_layout(buf: Source) -> tuple[np.dtype, int] | str:
    """``(token dtype, token count)`` of the llm.c shard held in ``buf`` (a 256-int32 header:
    magic, version, token count; then the tokens), or the reason it is not one (the header is
    missing or unknown, or its count does not match the size)."""
    size = len(buf)
    if size < LLMC_HEADER_BYTES:
        return f"{size} bytes, shorter than llm.c's {LLMC_HEADER_BYTES}-byte header"
    magic, version, count = (int(x) for x in np.frombuffer(buf, "<i4", count=3))
    dtype = LLMC_VERSIONS.get((magic, version))
    if dtype is None:
        return f"header magic {magic} version {version}, not one of {sorted(LLMC_VERSIONS)}"
    need = LLMC_HEADER_BYTES + count * dtype.itemsize
    if count < 0 or size != need:
        return (
            f"the header says {count} {dtype} tokens ({need} bytes with the header) but the "
            f"file holds {size} bytes"
        )
    return dtype, count


def _check_token_array(url: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
    if len(shape) != 1 or dtype.kind not in "iu":
        raise DataFileError(
            url,
            f"token arrays must be 1-D integer, got shape {shape} dtype {dtype}; "
            "re-save the tokens as a 1-D integer array",
        )


def _check_raw_size(url: str, nbytes: int, dtype: np.dtype) -> None:
    if nbytes % dtype.itemsize:
        raise DataFileError(
            url,
            f"the file holds {nbytes} bytes, not a multiple of the {dtype} item size "
            f"{dtype.itemsize}: it is truncated or the dtype is wrong; pass dtype=... or re-create it",
        )


def _not_ceped(url: str, reason: str) -> DataFileError:
    return DataFileError(
        url,
        f"not a CEPED .npy file, or truncated: {reason}; CEPED files hold "
        "[n][len(d1)..len(dn)][d1]..[dn] - re-create the file, or for a flat token "
        "array use file_type='flat' with eos_token=...",
    )


def _integer_dtype(dtype: Any, what: str) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.kind not in "iu":
        raise ValueError(f"{what}={dtype!r} must be an integer dtype (e.g. 'uint32')")
    return dt


# --------------------------------------------------------------------------- handlers
class CepedHandler(TokenArrayHandler):
    """CEPED ``.npy`` token files: ``[n] [len(d1) .. len(dn)] [d1] .. [dn]``.

    Args:
        col_name: unused (the file has no columns); accepted for a uniform signature.
        storage_options: fsspec keyword arguments.

    Documents are zero-copy slices of the memory-mapped (or fetched) array, in the file's dtype.
    """

    name: ClassVar[str] = "ceped"
    suffixes: ClassVar[tuple[str, ...]] = (".npy",)

    def __init__(
        self, col_name: str = "tokens", storage_options: dict[str, Any] | None = None
    ) -> None:
        super().__init__(col_name, storage_options)

    def open(self, url: str) -> TokenArrayReader:
        remote = self._open_remote(url)
        if remote is not None:
            return remote
        buf = read_source(url, self.storage_options)
        arr = parse_npy(url, buf)
        offsets = ceped_offsets(arr)
        if isinstance(offsets, str):
            raise _not_ceped(url, offsets)
        return TokenArrayReader(url, arr, offsets, "ceped")

    def open_ranged(self, url: str, open_ranges: OpenRanges) -> TokenArrayReader:
        """Open by range: the header, ``n`` and the lengths (three requests, plus the size)."""
        tokens = self._ranged_tokens(url, open_ranges(url), None)
        offsets = ceped_offsets(tokens)
        if isinstance(offsets, str):
            tokens.close()
            raise _not_ceped(url, offsets)
        return TokenArrayReader(url, tokens, offsets, "ceped")


class FlatTokenHandler(TokenArrayHandler):
    """One flat token array per file (``.bin`` raw or 1-D ``.npy``), split into documents.

    Args:
        col_name: unused (the file has no columns); accepted for a uniform signature.
        storage_options: fsspec keyword arguments.
        eos_token: documents end with this token (included in the document); a trailing run
            without it is the last document. Ignored when an offsets sidecar exists.
        dtype: element type of raw (non-``.npy``) files, default ``uint32``. A ``.npy`` file
            (recognised by its magic bytes, whatever its name) always uses its own dtype.

    Document boundaries: the sidecar ``<url>.offsets.npy`` (int64, ``n + 1`` non-decreasing
    offsets from 0 to the token count) when it exists, else ``eos_token`` splitting. With
    neither, ``open`` raises :class:`DataFileError`. EOS splitting cannot express empty
    documents (each document holds at least its EOS token); the sidecar can.
    """

    name: ClassVar[str] = "flat"
    suffixes: ClassVar[tuple[str, ...]] = (".bin",)

    def __init__(
        self,
        col_name: str = "tokens",
        storage_options: dict[str, Any] | None = None,
        eos_token: int | None = None,
        dtype: Any = "uint32",
    ) -> None:
        super().__init__(col_name, storage_options)
        self.eos_token = None if eos_token is None else operator.index(eos_token)
        self.dtype = _integer_dtype(dtype, "dtype")

    def open(self, url: str) -> TokenArrayReader:
        remote = self._open_remote(url)
        if remote is not None:
            return remote
        buf = read_source(url, self.storage_options)
        if bytes(buf[:6]) != NPY_MAGIC:  # an llm.c shard (its header checks out) is read so
            layout = llmc_layout(buf)
            if not isinstance(layout, str):
                return self.llmc_reader(url, buf, layout)
        tokens = self._token_array(url, buf, self.dtype)
        offsets = self._flat_offsets(url, tokens, self.eos_token)
        return TokenArrayReader(url, tokens, offsets, "flat")

    def llmc_reader(self, url: str, buf: Source, layout: tuple[np.dtype, int]) -> TokenArrayReader:
        """The reader of the llm.c shard in ``buf`` (``layout`` from :func:`llmc_layout`): its
        tokens after the header, split by the sidecar, else at ``eos_token`` past the EOT that
        starts the file (llm.c writes one before every document)."""
        dtype, count = layout
        tokens = np.frombuffer(buf, dtype=dtype, count=count, offset=LLMC_HEADER_BYTES)
        eos = self.eos_token
        sidecar = source_exists(url + OFFSETS_SUFFIX, self.storage_options)
        if not sidecar and eos is not None and tokens.size and int(tokens[0]) == eos:
            tokens = tokens[1:]
        return TokenArrayReader(url, tokens, self._flat_offsets(url, tokens, eos), "llmc")

    def open_ranged(self, url: str, open_ranges: OpenRanges) -> TokenArrayReader | None:
        """Open by range when an offsets sidecar gives the boundaries (the header and the
        sidecar are read, then each document when asked for); None without one (splitting on
        ``eos_token`` reads every token: the file is read whole)."""
        source = open_ranges(url)
        head = read_exact(source, 0, min(source.size, 12), "the file's first bytes")
        if len(head) == 12 and tuple(np.frombuffer(head, "<i4", count=2)) in LLMC_VERSIONS:
            return None  # an llm.c shard: read whole (its header and tokens, see open)
        tokens = self._ranged_tokens(url, source, self.dtype, head)
        offsets = self._ranged_sidecar(url, open_ranges, tokens.size)
        if offsets is None:
            tokens.close()
            return None
        return TokenArrayReader(url, tokens, offsets, "flat")

    def __repr__(self) -> str:
        return f"FlatTokenHandler(eos_token={self.eos_token!r}, dtype={str(self.dtype)!r})"


class NpyHandler(TokenArrayHandler):
    """``.npy`` token files, CEPED or flat, told apart by content.

    Args:
        col_name: unused (the file has no columns); accepted for a uniform signature.
        storage_options: fsspec keyword arguments.
        eos_token: for flat files without an offsets sidecar, as in :class:`FlatTokenHandler`.

    Sniffing, in order: an offsets sidecar ``<url>.offsets.npy`` means flat; a 1-D integer
    array that passes the CEPED validation exactly means CEPED; anything else is flat (and
    needs ``eos_token`` or the sidecar). ``reader.kind`` tells which was chosen. Pass
    ``file_type="ceped"`` or ``"flat"`` to skip the sniff when the format is known.
    """

    name: ClassVar[str] = "npy"
    suffixes: ClassVar[tuple[str, ...]] = (".npy",)

    def __init__(
        self,
        col_name: str = "tokens",
        storage_options: dict[str, Any] | None = None,
        eos_token: int | None = None,
    ) -> None:
        super().__init__(col_name, storage_options)
        self.eos_token = None if eos_token is None else operator.index(eos_token)

    def open(self, url: str) -> TokenArrayReader:
        remote = self._open_remote(url)
        if remote is not None:
            return remote
        buf = read_source(url, self.storage_options)
        tokens = self._token_array(url, buf, None)
        if not source_exists(url + OFFSETS_SUFFIX, self.storage_options):
            offsets = ceped_offsets(tokens)
            if not isinstance(offsets, str):
                return TokenArrayReader(url, tokens, offsets, "ceped")
            reason = f"not a CEPED array ({offsets}), so read as flat tokens"
        else:
            reason = ""
        return TokenArrayReader(
            url, tokens, self._flat_offsets(url, tokens, self.eos_token, reason), "flat"
        )

    def open_ranged(self, url: str, open_ranges: OpenRanges) -> TokenArrayReader | None:
        """Open by range, sniffing as :meth:`open` does: flat with an offsets sidecar, else
        CEPED when ``n`` and the lengths check out; None for a flat file split on
        ``eos_token`` (read whole)."""
        tokens = self._ranged_tokens(url, open_ranges(url), None)
        offsets = self._ranged_sidecar(url, open_ranges, tokens.size)
        if offsets is not None:
            return TokenArrayReader(url, tokens, offsets, "flat")
        ceped = ceped_offsets(tokens)
        if not isinstance(ceped, str):
            return TokenArrayReader(url, tokens, ceped, "ceped")
        tokens.close()
        return None

    def __repr__(self) -> str:
        return f"NpyHandler(eos_token={self.eos_token!r})"
