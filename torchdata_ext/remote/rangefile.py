"""Range reads of a remote object through a :class:`~torchdata_ext.remote.ShardCache`.

With ``ShardCache(range_reads=True)`` the reader opens Arrow IPC and Parquet files as a
:class:`RangeFile` (:meth:`ShardCache.open_range <torchdata_ext.remote.ShardCache.open_range>`)
instead of downloading them: block-sized HTTP range requests with retries, counted in the
cache's :meth:`~torchdata_ext.remote.ShardCache.stats`.
"""

from __future__ import annotations

import errno
import io
import time
from typing import TYPE_CHECKING, Any

from torchdata_ext.remote.retry import RemoteError, with_retries

if TYPE_CHECKING:
    from torchdata_ext.remote.cache import ShardCache

__all__ = ["RangeFile"]


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote object through range requests (with retries).

    Reads of less than ``block_size`` bytes are served from whole blocks, keeping the last few.
    Time spent in requests counts as ``wait_seconds`` of the cache. With ``listed``, ``size``
    is the one the dataset index lists rather than the store's answer to a HEAD: the request
    that reaches the end asks for one byte more, so an object that grew or shrank since the
    index was made is refused there, with no request of its own.
    """

    _KEEP_BLOCKS = 4

    def __init__(
        self, cache: ShardCache, fs: Any, path: str, url: str, size: int, listed: bool = False
    ) -> None:
        super().__init__()
        self._cache = cache
        self._fs = fs
        self._path = path
        self.url = url
        self.size = size
        self.listed = listed
        self._pos = 0
        self._blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def _get(self, start: int, end: int) -> bytes:
        rt = self._cache._runtime()
        t0 = time.perf_counter()

        def count_retry(_: BaseException) -> None:
            with rt.mu:
                self._cache._count("retries")

        # one byte past a listed size's end: only an object of another size sends it back
        ask = end + 1 if self.listed and end == self.size else end
        try:
            data = with_retries(
                lambda: self._fs.cat_file(self._path, start=start, end=ask),
                self.url, self._cache.retry, what="range read", on_retry=count_retry,
            )  # fmt: skip
        except OSError as exc:  # S3's InvalidRange: the object ends before ``start``
            if self.listed and exc.errno == errno.EINVAL and not isinstance(exc, RemoteError):
                raise self._wrong_size(f"the object has fewer than {start}") from exc
            raise
        if len(data) != end - start:
            if self.listed:
                got = len(data)
                raise self._wrong_size(
                    "the object is longer" if got > end - start else f"the object has {start + got}"
                )
            raise RemoteError(
                self.url,
                f"a range read of bytes {start}..{end} returned {len(data)} bytes; the object "
                "changed while it was read: rebuild the dataset index",
            )
        seconds = time.perf_counter() - t0
        with rt.mu:
            self._cache._count("range_requests")
            self._cache._count("bytes_downloaded", len(data))
            self._cache._count("wait_seconds", seconds)
            self._cache._count("download_seconds", seconds)
        return bytes(data)

    def _wrong_size(self, what: str) -> RemoteError:
        return RemoteError(
            self.url,
            f"the dataset index lists {self.size} bytes, but {what}: the file changed after "
            "the index was made (rebuild it with `torchdata-ext index`)",
        )

    def pread(self, start: int, end: int) -> bytes:
        """Bytes ``start .. end`` (end excluded, clipped to the size) with one range request of
        exactly those bytes, whatever ``block_size``: what a token handler reads a document
        with. The position is left unchanged."""
        end = min(end, self.size)
        return self._get(start, end) if end > start else b""

    def read(self, size: int | None = -1) -> bytes:
        start = self._pos
        end = self.size if size is None or size < 0 else min(self.size, start + size)
        if end <= start:
            return b""
        bs = self._cache.block_size
        if end - start >= bs:
            data = self._get(start, end)
        else:
            chunks = []
            for k in range(start // bs, (end - 1) // bs + 1):
                block = self._blocks.pop(k, None)
                if block is None:
                    block = self._get(k * bs, min(self.size, (k + 1) * bs))
                self._blocks[k] = block  # most recent last
                lo = max(start, k * bs) - k * bs
                hi = min(end, (k + 1) * bs) - k * bs
                chunks.append(block[lo:hi])
            while len(self._blocks) > self._KEEP_BLOCKS:
                self._blocks.pop(next(iter(self._blocks)))
            data = b"".join(chunks)
        self._pos = end
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        n = len(data)
        memoryview(buffer).cast("B")[:n] = data
        return n
