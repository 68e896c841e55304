"""JSON Lines text files (``.jsonl``, ``.json``, and their ``.gz`` / ``.zst`` variants).

One JSON object per line; the document is the string in field ``col_name`` (default
``"text"``). Blank (empty or whitespace-only) lines are skipped and do not count as documents;
a UTF-8 byte-order mark at the start is ignored; CRLF line ends are fine.

On ``open`` the whole file is decompressed into memory (gzip, or zstd via the optional
``zstandard`` package; the compression is recognised by its magic bytes) and line offsets are
found with NumPy; uncompressed local files are memory-mapped instead. Each line is parsed with
``json.loads`` only when its document is asked for, so a bad line is reported (file, line
number, field) when it is read.
"""

from __future__ import annotations

import gzip
import json
import mmap
import zlib
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from torchdata_ext.handlers.base import DataFileError, FileHandler
from torchdata_ext.handlers.numpy_tokens import Source, check_index, check_indices, read_source

__all__ = ["JsonlHandler", "JsonlReader", "release_pages"]

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_BOM = b"\xef\xbb\xbf"
_COMPRESSIONS = {
    None: None,
    "none": None,
    "infer": "infer",
    "gz": "gzip",
    "gzip": "gzip",
    "zst": "zstd",
    "zstd": "zstd",
}


def _zstandard() -> Any:
    try:
        import zstandard
    except ImportError:
        raise ImportError(
            "reading .zst files needs the zstandard package: pip install zstandard "
            "(or pip install 'torchdata-ext[zstd]')"
        ) from None
    return zstandard


def gunzip(url: str, raw: Source) -> bytes:
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataFileError(
            url, f"gzip data is truncated or corrupt ({exc}); re-create or re-download the file"
        ) from exc


def unzstd(url: str, raw: Source) -> bytes:
    zstandard = _zstandard()
    dctx = zstandard.ZstdDecompressor()
    out: list[bytes] = []
    data: Any = memoryview(raw)
    try:
        while len(data):  # one decompressobj per frame (files may hold several frames)
            obj = dctx.decompressobj()
            out.append(obj.decompress(data))
            if not obj.eof:
                raise DataFileError(
                    url, "zstd data is truncated (the last frame has no end); re-create or "
                    "re-download the file",
                )  # fmt: skip
            data = obj.unused_data
    except zstandard.ZstdError as exc:
        raise DataFileError(
            url, f"zstd data is corrupt ({exc}); re-create or re-download the file"
        ) from exc
    return b"".join(out)


class JsonlReader:
    """An opened JSON Lines file.

    Attributes:
        url: the file.
        data: the decompressed bytes (or the memory map of an uncompressed local file).
        starts, ends: int64 byte offsets of each non-blank line (without the newline).
        compression: ``None``, ``"gzip"`` or ``"zstd"``.
        produces: always ``"text"``.
    """

    produces = "text"

    def __init__(
        self, url: str, data: Source, starts: np.ndarray, ends: np.ndarray, compression: str | None
    ) -> None:
        self.url = url
        self.data = data
        self.starts = starts
        self.ends = ends
        self.compression = compression

    def __len__(self) -> int:
        return int(self.starts.size)

    def line_number(self, i: int) -> int:
        """1-based line number (in the decompressed text) of document ``i``."""
        start = int(self.starts[i])
        return int(np.count_nonzero(np.frombuffer(self.data, np.uint8, count=start) == 10)) + 1

    def close(self) -> None:
        self.data = b""
        self.starts = self.ends = np.zeros(0, dtype=np.int64)

    def __enter__(self) -> JsonlReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"JsonlReader({self.url!r}, docs={len(self)})"


_SCAN = 1 << 24  # bytes scanned at a time (a multiple of the page size)


def release_pages(data: Source, lo: int = 0, hi: int | None = None) -> None:
    """Let the kernel drop this process's resident pages of bytes ``lo .. hi`` of ``data``
    when it is a memory map of a file (read again from the file when touched): a long scan
    of a large file then does not keep the whole file resident. Anything else: nothing."""
    if not isinstance(data, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    lo = lo // page * page
    hi = len(data) if hi is None else min(hi, len(data))
    if hi > lo:
        data.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def line_offsets(data: Source) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets ``(starts, ends)`` of the non-blank lines of ``data``, vectorised, scanned
    16 MiB at a time (a memory-mapped file's pages released after each: memory is the
    offsets, 16 bytes a line, not the file)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    n = buf.size
    parts = [np.zeros(0, np.int64)]
    for lo in range(0, n, _SCAN):
        parts.append(np.flatnonzero(buf[lo : lo + _SCAN] == 10) + lo)
        release_pages(data, lo, lo + _SCAN)
    newlines = np.concatenate(parts)
    starts = np.empty(newlines.size + 1, dtype=np.int64)
    starts[0] = 3 if bytes(data[:3]) == _BOM else 0
    starts[1:] = newlines + 1
    ends = np.empty_like(starts)
    ends[:-1] = newlines
    ends[-1] = n
    keep = ends > starts
    # lines starting with whitespace may be blank: check those few in Python
    candidates = np.flatnonzero(keep)
    at = starts[candidates]
    first = np.empty(at.size, np.uint8)
    for lo in range(0, n, _SCAN):
        a, b = np.searchsorted(at, [lo, lo + _SCAN])
        first[a:b] = buf[at[a:b]]
        release_pages(data, lo, lo + _SCAN)
    for k in candidates[np.isin(first, (9, 11, 12, 13, 32))].tolist():
        if not bytes(data[starts[k] : ends[k]]).strip():
            keep[k] = False
    return starts[keep], ends[keep]


class JsonlHandler(FileHandler):
    """JSON Lines text files; one document (a ``str``) per non-blank line.

    Args:
        col_name: the JSON field holding the text, default ``"text"``.
        storage_options: fsspec keyword arguments.
        compression: ``"infer"`` (default: by magic bytes; a ``.gz``/``.zst`` name whose
            content is not compressed is an error), ``None`` (plain), ``"gzip"`` or ``"zstd"``.

    ``doc_lengths`` is None: character counts would need every line parsed.
    """

    name: ClassVar[str] = "jsonl"
    suffixes: ClassVar[tuple[str, ...]] = (
        ".jsonl",
        ".json",
        ".jsonl.gz",
        ".json.gz",
        ".jsonl.zst",
        ".json.zst",
    )
    produces: ClassVar[str] = "text"

    def __init__(
        self,
        col_name: str = "text",
        storage_options: dict[str, Any] | None = None,
        compression: str | None = "infer",
    ) -> None:
        super().__init__(col_name, storage_options)
        if compression not in _COMPRESSIONS:
            raise ValueError(
                f"{compression=} must be one of 'infer', None, 'gzip'/'gz', 'zstd'/'zst'"
            )
        self.compression = _COMPRESSIONS[compression]

    def _compression_of(self, url: str, raw: Source) -> str | None:
        if self.compression != "infer":
            return self.compression
        head = bytes(raw[:4])
        if head.startswith(GZIP_MAGIC):
            return "gzip"
        if head.startswith(ZSTD_MAGIC):
            return "zstd"
        name = url.lower()
        for suffix, comp in ((".gz", "gzip"), (".zst", "zstd")):
            if name.endswith(suffix) and raw:
                raise DataFileError(
                    url,
                    f"the name ends in {suffix} but the content is not {comp} data; rename the "
                    "file or pass compression=None",
                )
        return None

    def open(self, url: str) -> JsonlReader:
        raw = read_source(url, self.storage_options)
        compression = self._compression_of(url, raw)
        if compression == "gzip":
            data: Source = gunzip(url, raw)
        elif compression == "zstd":
            data = unzstd(url, raw)
        else:
            data = raw
        starts, ends = line_offsets(data)
        if starts.size and data[int(starts[0])] == ord("["):
            raise DataFileError(
                url,
                "the file starts with '[': it looks like a JSON array, not JSON Lines; write one "
                "JSON object per line",
            )
        return JsonlReader(url, data, starts, ends, compression)

    def produces_for(self, reader: JsonlReader) -> str:
        """Always ``"text"``."""
        return reader.produces

    def length(self, reader: JsonlReader) -> int:
        return int(reader.starts.size)

    def get(self, reader: JsonlReader, index: int) -> str:
        i = check_index(reader.url, index, int(reader.starts.size))
        line = reader.data[int(reader.starts[i]) : int(reader.ends[i])]
        try:
            obj = json.loads(line)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise DataFileError(
                reader.url,
                f"line {reader.line_number(i)} is not valid JSON ({exc}); fix or remove that line",
            ) from exc
        if not isinstance(obj, dict):
            raise DataFileError(
                reader.url,
                f"line {reader.line_number(i)} is a JSON {type(obj).__name__}, not an object with "
                f"a {self.col_name!r} field; write one JSON object per line",
            )
        try:
            text = obj[self.col_name]
        except KeyError:
            raise DataFileError(
                reader.url,
                f"line {reader.line_number(i)} has no field {self.col_name!r}; its fields are "
                f"{list(obj)[:20]}; pass col_name=...",
            ) from None
        if not isinstance(text, str):
            raise DataFileError(
                reader.url,
                f"line {reader.line_number(i)}: field {self.col_name!r} is a JSON "
                f"{type(text).__name__}, not a string; pass col_name=... naming the text field",
            )
        return text

    def get_many(self, reader: JsonlReader, indices: Sequence[int] | np.ndarray) -> list[Any]:
        idx = check_indices(reader.url, indices, int(reader.starts.size))
        return [self.get(reader, i) for i in idx.tolist()]

    def close(self, reader: JsonlReader) -> None:
        reader.close()
