"""Big token files on object storage are read by range: the header and index when opened, then
the documents read, never the whole file (CEPED ``.npy``, flat ``.bin``/``.npy`` with an offsets
sidecar, Megatron pairs); a flat file split on ``eos_token`` is still read whole."""

from __future__ import annotations

import collections
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np
import pytest
from conftest import S3Endpoint

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext import testing as T
from torchdata_ext.handlers import (
    CepedHandler,
    FileHandler,
    FlatTokenHandler,
    MegatronHandler,
    NpyHandler,
)
from torchdata_ext.handlers.ranged import FsRanges
from torchdata_ext.remote import ShardCache
from torchdata_ext.sources.file_access import FileAccess


class CountingRanges(FsRanges):
    """FsRanges that records every range read."""

    reads: list[tuple[str, int, int]] = []

    def pread(self, start: int, end: int) -> bytes:
        CountingRanges.reads.append((self.url.rsplit("/", 1)[1], start, end))
        return super().pread(start, end)


@pytest.fixture
def mem() -> Iterator[str]:
    prefix = f"memory://range-reads-{uuid.uuid4().hex}"
    yield prefix
    fs = fsspec.filesystem("memory")
    if fs.exists(prefix):
        fs.rm(prefix, recursive=True)


# name, writer, handler, bytes before the tokens (header), index bytes read besides the file's
LAYOUTS = [
    ("f.bin", lambda u, d: T.write_flat_tokens(u, d, offsets=True), FlatTokenHandler, 0),
    ("f.npy", lambda u, d: T.write_flat_tokens(u, d, offsets=True, dtype=np.uint16),
     FlatTokenHandler, 128),
    ("s.npy", lambda u, d: T.write_flat_tokens(u, d, offsets=True), NpyHandler, 128),
    ("c.npy", T.write_ceped_npy, CepedHandler, 128),
    ("cs.npy", lambda u, d: T.write_ceped_npy(u, d, dtype=np.int32), NpyHandler, 128),
    ("m.idx", lambda u, d: T.write_megatron(u, d, sentences=2), MegatronHandler, 0),
]  # fmt: skip


@pytest.mark.parametrize(("name", "write", "handler_cls", "header"), LAYOUTS,
                         ids=[x[0] for x in LAYOUTS])  # fmt: skip
def test_open_ranged_reads_the_index_then_only_the_documents_read(
    mem: str, name: str, write: Any, handler_cls: type[FileHandler], header: int
) -> None:
    rng = np.random.default_rng(len(name))
    docs = [rng.integers(1, 30000, size=int(rng.integers(0, 50))) for _ in range(40)]
    url = f"{mem}/{name}"
    expected = write(url, docs)
    handler = handler_cls()
    CountingRanges.reads = []
    reader = handler.open_ranged(url, CountingRanges)
    opened = list(CountingRanges.reads)
    assert reader is not None and handler.length(reader) == 40
    data_file = name.replace(".idx", ".bin")
    # opening read no token of the data file past its header (a CEPED file: its n and its
    # lengths; a raw .bin: the 12 bytes that tell it from a .npy and an llm.c shard)
    n_lengths = 41 if "c" in name else 0
    item = expected[0].dtype.itemsize
    limit = max(header + n_lengths * item, 12)
    assert all(end <= limit for f, _, end in opened if f == data_file), opened
    CountingRanges.reads = []
    picks = [3, 17, 3, 39]
    got = handler.get_many(reader, picks)
    for i, doc in zip(picks, got, strict=True):
        assert doc.dtype == expected[i].dtype and np.array_equal(doc, expected[i])
    # one request per non-empty document read, of exactly its bytes
    nbytes = sorted(end - start for _, start, end in CountingRanges.reads)
    assert nbytes == sorted(len(expected[i]) * item for i in picks if len(expected[i]))
    assert all(np.array_equal(handler.get(reader, i), expected[i]) for i in range(40))
    handler.close(reader)


def test_a_flat_file_split_on_eos_is_not_read_by_range(mem: str) -> None:
    url = f"{mem}/f.bin"
    T.write_flat_tokens(url, [np.arange(1, 5)] * 3, eos_token=0)
    assert FlatTokenHandler(eos_token=0).open_ranged(url, CountingRanges) is None
    # a flat .npy without a sidecar that is no CEPED array either: read whole, as before
    T.write_flat_tokens(f"{mem}/e.npy", [np.arange(1, 5)] * 3, eos_token=0)
    assert NpyHandler(eos_token=0).open_ranged(f"{mem}/e.npy", CountingRanges) is None
    reader = NpyHandler(eos_token=0).open(f"{mem}/e.npy")
    assert reader.kind == "flat" and isinstance(reader.tokens, np.ndarray)


def _flat_on_s3(s3: S3Endpoint, n_docs: int = 400, length: int = 2500) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 2**31, size=length).astype(np.uint32) for _ in range(n_docs)]
    for part in (0, 1):
        T.write_flat_tokens(s3.url("flat", f"part{part}.bin"), docs[part::2], offsets=True,
                            storage_options=s3.storage_options)  # fmt: skip
    return docs


def test_big_files_are_read_by_range_through_the_cache(s3: S3Endpoint, tmp_path: Any) -> None:
    _flat_on_s3(s3)
    so = s3.storage_options
    ix = DatasetIndex.build(s3.url("flat"), file_type="flat", storage_options=so)
    size = ix.file_stats[0][0]
    assert size == 200 * 2500 * 4
    for above, by_range in ((size, True), (size + 1, False), (None, False)):
        folder = tmp_path / f"cache-{above}"  # a cold cache each time
        cache = ShardCache(folder, range_reads_above=above, storage_options=so, max_bytes=None)
        try:
            access = FileAccess(ix, cache, prefetch=1)
            assert access.open(0, [1]) == 200
            docs = access.get_many(np.array([5, 150, 60]))
            stats = access.io_stats()
            access.close_all()
        finally:
            cache.close()
        assert [len(d) for d in docs] == [2500] * 3
        if by_range:  # 12 bytes (no .npy, no llm.c), the sidecar (201 offsets), 3 documents
            assert stats["downloads"] == 0
            assert stats["bytes_downloaded"] == 12 + 128 + 201 * 8 + 3 * 2500 * 4
        else:  # as before: the file (and the next one, prefetched) downloaded whole
            assert stats["downloads"] >= 1 and stats["bytes_downloaded"] >= size


def test_without_a_cache_remote_files_are_read_by_range(s3: S3Endpoint) -> None:
    docs = _flat_on_s3(s3, n_docs=20, length=10)
    so = s3.storage_options
    reader = FlatTokenHandler(storage_options=so).open(s3.url("flat", "part1.bin"))
    assert type(reader.tokens).__name__ == "RangedTokens"
    assert np.array_equal(reader.tokens[10:20], docs[3])


def test_one_epoch_over_range_reads_delivers_every_document_once(s3: S3Endpoint) -> None:
    docs = _flat_on_s3(s3, n_docs=60, length=7)
    so = s3.storage_options
    ix = DatasetIndex.build(s3.url("flat"), file_type="flat", storage_options=so)
    cache = ShardCache(range_reads_above=0, storage_options=so)
    try:
        reader = ShardReader(ix, 4, world=World(), epochs=1, block_docs=8, cache=cache)
        got: collections.Counter[tuple[int, ...]] = collections.Counter()
        for block in reader:
            for k in range(len(block.offsets) - 1):
                got[tuple(block.tokens[block.offsets[k] : block.offsets[k + 1]].tolist())] += 1
        stats = reader.io_stats()
        reader.close()
    finally:
        cache.close()
    assert got == collections.Counter(tuple(d.tolist()) for d in docs)
    assert stats["downloads"] == 0
