"""Token arrays read by byte range: big token files on object storage, never fetched whole.

A token file's documents are slices of one array at a byte offset in the file (a flat ``.bin``,
a ``.npy`` past its header, a Megatron ``.bin``). Locally that array is a memory map; on other
filesystems :class:`RangedTokens` stands in for it: slicing it (``tokens[a:b]``) reads exactly
bytes ``offset + a * itemsize .. offset + b * itemsize`` with one range request, so a reader
reads what the documents it is asked for hold, plus the index that says where they are.

:class:`ByteRanges` is what the range requests go through: :class:`FsRanges` (plain fsspec
``cat_file`` with ``start``/``end``, for readers without a cache) or the
:class:`~torchdata_ext.remote.rangefile.RangeFile` of a
:class:`~torchdata_ext.remote.ShardCache` (retries, and the cache's ``range_requests`` and
``bytes_downloaded`` counters).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from torchdata_ext.handlers.base import DataFileError
from torchdata_ext.remote.urls import filesystem, is_local, protocol_of

__all__ = [
    "READ_THREADS",
    "ByteRanges",
    "FsRanges",
    "OpenRanges",
    "RangedTokens",
    "read_exact",
    "reads_by_range",
]

READ_THREADS = 8
"""Range requests a :class:`RangedTokens` sends at once for the documents of one ``get_many``
(a block of documents the walk visits in random order: one request each, overlapped)."""


def reads_by_range(fs: Any) -> bool:
    """Whether token files on ``fs`` are opened by range rather than read whole: any filesystem
    but the local one (memory-mapped) and ``memory://`` (already in this process's memory)."""
    return not is_local(fs) and protocol_of(fs) != "memory"


class ByteRanges(Protocol):
    """A remote object read by byte range.

    Attributes:
        url: the object.
        size: its size in bytes.
    """

    url: str
    size: int

    def pread(self, start: int, end: int) -> bytes:
        """Bytes ``start .. end`` (end excluded) of the object, with one request."""
        ...


OpenRanges = Callable[[str], ByteRanges]
"""Opens a URL (a data file or a side file next to it) for range reads."""


class FsRanges:
    """:class:`ByteRanges` over an fsspec filesystem (one ``cat_file(start=, end=)`` a read).

    Args:
        url: the object.
        storage_options: fsspec keyword arguments.

    The size is asked of the store once (``fs.info``), when the object is opened.

    Raises:
        DataFileError: the object does not exist.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self._fs, self._path = filesystem(url, storage_options)
        try:
            self.size = int(self._fs.info(self._path)["size"])
        except FileNotFoundError:
            raise DataFileError(
                url, "file not found; check the path (and storage_options for a remote filesystem)"
            ) from None

    def pread(self, start: int, end: int) -> bytes:
        """Bytes ``start .. end`` of the object (one request)."""
        return bytes(self._fs.cat_file(self._path, start=start, end=end))


def read_exact(source: ByteRanges, start: int, end: int, what: str) -> bytes:
    """Bytes ``start .. end`` of ``source``; a :class:`DataFileError` naming ``what`` (e.g.
    ``"the index"``) when the object ends before ``end`` (truncated)."""
    if end <= start:
        return b""
    if end > source.size:
        raise DataFileError(
            source.url,
            f"truncated: {what} needs bytes {start}..{end} but the file holds {source.size}; "
            "re-create or re-upload the file",
        )
    data = source.pread(start, end)
    if len(data) != end - start:
        raise DataFileError(
            source.url,
            f"truncated: read {len(data)} of the {end - start} bytes of {what} at {start}; "
            "re-create or re-upload the file",
        )
    return data


class RangedTokens:
    """A 1-D token array stored in a remote object, read by range when sliced.

    Args:
        source: the object.
        dtype: the tokens' type as stored (its byte order included).
        offset: the byte offset of token 0 in the object.
        size: the number of tokens.

    Only slices with step 1 are supported (``tokens[a:b]``, what the token handlers take);
    each returns a read-only NumPy array of ``b - a`` tokens read with one request.
    :meth:`take` reads many slices, :data:`READ_THREADS` requests at a time; :meth:`close`
    stops its threads.
    """

    ndim = 1

    def __init__(self, source: ByteRanges, dtype: np.dtype, offset: int, size: int) -> None:
        self.source = source
        self.dtype = np.dtype(dtype)
        self.offset = int(offset)
        self.size = int(size)
        self._pool: ThreadPoolExecutor | None = None
        self._mu = threading.Lock()

    def take(self, starts: Sequence[int], ends: Sequence[int]) -> list[np.ndarray]:
        """``[self[s:e] for s, e in zip(starts, ends)]``, up to :data:`READ_THREADS` requests
        at a time (an empty slice sends none)."""
        if len(starts) <= 1:
            return [self[s:e] for s, e in zip(starts, ends, strict=True)]
        with self._mu:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="range-read")
            pool = self._pool
        return list(pool.map(lambda se: self[se[0] : se[1]], zip(starts, ends, strict=True)))

    def close(self) -> None:
        """Stop the threads of :meth:`take` (it starts them again if called after)."""
        with self._mu:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __len__(self) -> int:
        return self.size

    @property
    def shape(self) -> tuple[int]:
        """``(size,)``, as a 1-D array's."""
        return (self.size,)

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"RangedTokens takes slices with step 1, not {key!r}")
        start, stop, _ = key.indices(self.size)
        stop = max(start, stop)
        item = self.dtype.itemsize
        data = read_exact(
            self.source,
            self.offset + start * item,
            self.offset + stop * item,
            f"tokens {start}..{stop}",
        )
        return np.frombuffer(data, dtype=self.dtype)

    def __repr__(self) -> str:
        return f"RangedTokens({self.source.url!r}, dtype={self.dtype}, size={self.size})"
