"""Megatron indexed datasets (``.bin`` + ``.idx``): files written by megatron-core's own
``IndexedDatasetBuilder`` (skipped when megatron-core is not installed) and by this test's
writer, read locally (memory map), on ``memory://`` and on S3 by range, through the handler and
through the whole pipeline."""

from __future__ import annotations

import collections
import struct
import warnings
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from conftest import S3Endpoint
from harness import delivered_documents

from torchdata_ext import DataFileError, DatasetIndex, PipelineConfig, World, build_pipeline
from torchdata_ext.handlers import MegatronHandler, get_handler
from torchdata_ext.handlers.megatron import INDEX_MAGIC
from torchdata_ext.remote import ShardCache
from torchdata_ext.sources.file_access import FileAccess
from torchdata_ext.testing import write_megatron

# Megatron's DType codes, integer ones (megatron.core.datasets.indexed_dataset.DType)
INT_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def _megatron() -> Any:
    """megatron-core's indexed_dataset module, or a skip saying how to install it."""
    try:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
    except ImportError:
        pytest.skip(
            "megatron-core is not installed: pip install --no-deps megatron-core==0.16.1 "
            "packaging (as .ci/run does)"
        )
    return indexed_dataset


def documents(rng: np.random.Generator, n: int, dtype: Any) -> list[list[np.ndarray]]:
    """``n`` documents, each a list of 0..3 sequences ("sentences") of 0..12 tokens of ``dtype``
    (values spread over the dtype's range, negative ones included where it has them)."""
    info = np.iinfo(dtype)
    lo, hi = max(int(info.min), -30000), min(int(info.max), 60000)
    return [
        [rng.integers(lo, hi + 1, size=int(rng.integers(0, 13))).astype(dtype)
         for _ in range(int(rng.integers(0, 4)))]
        for _ in range(n)
    ]  # fmt: skip


def write_with_megatron(prefix: str, docs: list[list[np.ndarray]], dtype: Any) -> None:
    """Write ``docs`` with megatron-core's builder as ``preprocess_data.py`` does: one
    ``add_item`` per sentence, ``end_document`` per document."""
    import torch

    mc = _megatron()
    builder = mc.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(torch.from_numpy(seq.astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def joined(docs: list[list[np.ndarray]], dtype: Any) -> list[np.ndarray]:
    """Each document's tokens: its sequences in order."""
    return [np.concatenate([np.zeros(0, dtype), *d]).astype(dtype) for d in docs]


def _check_reads(url: str, expected: list[np.ndarray], dtype: Any, **options: Any) -> None:
    handler = MegatronHandler(**options)
    reader = handler.open(url)
    assert handler.length(reader) == len(expected)
    for i, doc in enumerate(expected):
        got = handler.get(reader, i)
        assert got.dtype == np.dtype(dtype) and np.array_equal(got, doc), i
    order = np.random.default_rng(1).permutation(len(expected))
    for i, got in zip(order, handler.get_many(reader, order), strict=True):
        assert np.array_equal(got, expected[i])
    assert np.array_equal(handler.doc_lengths(reader), [len(d) for d in expected])
    handler.close(reader)


@pytest.mark.parametrize("dtype", list(INT_CODES), ids=[np.dtype(t).name for t in INT_CODES])
def test_files_megatron_core_writes_read_as_its_own_reader_reads_them(
    tmp_path: Path, dtype: Any
) -> None:
    mc = _megatron()
    docs = documents(np.random.default_rng(INT_CODES[dtype]), 25, dtype)
    prefix = str(tmp_path / "corpus_text_document")
    write_with_megatron(prefix, docs, dtype)
    expected = joined(docs, dtype)
    # megatron-core's reader agrees with the documents written (sequences joined per document)
    theirs = mc.IndexedDataset(prefix)
    bounds = theirs.document_indices
    assert len(bounds) - 1 == len(docs)
    for d in range(len(docs)):
        seqs = [theirs[s] for s in range(bounds[d], bounds[d + 1])]
        assert np.array_equal(np.concatenate([np.zeros(0, dtype), *seqs]), expected[d])
    # documents, not sequences: the two counts differ here
    assert len(theirs) != len(docs)
    for url in (prefix + ".idx", prefix + ".bin"):  # listed by either file
        _check_reads(url, expected, dtype)
    # on memory:// (not local): by range, the same documents
    mem = f"memory://megatron-{np.dtype(dtype).name}-{tmp_path.name}/c"
    fs = fsspec.filesystem("memory")
    try:
        for suffix in (".idx", ".bin"):
            fs.pipe(mem[len("memory://") :] + suffix, Path(prefix + suffix).read_bytes())
        _check_reads(mem + ".idx", expected, dtype)
    finally:
        fs.rm(mem[len("memory://") :].rsplit("/", 1)[0], recursive=True)


def test_files_this_project_writes_read_the_same(tmp_path: Path) -> None:
    for dtype in INT_CODES:
        docs = documents(np.random.default_rng(3), 17, dtype)
        prefix = str(tmp_path / np.dtype(dtype).name)
        expected = write_megatron(prefix + ".idx", joined(docs, dtype), dtype, sentences=3)
        assert all(np.array_equal(a, b) for a, b in zip(expected, joined(docs, dtype)))
        _check_reads(prefix + ".idx", expected, dtype)


def test_local_documents_are_zero_copy_views_of_the_bin(tmp_path: Path) -> None:
    write_megatron(str(tmp_path / "a.idx"), [np.arange(5), np.arange(7)], np.uint16)
    handler = MegatronHandler()
    reader = handler.open(str(tmp_path / "a.idx"))
    doc = handler.get(reader, 1)
    assert not doc.flags.owndata and not doc.flags.writeable
    assert np.array_equal(doc, np.arange(7))


def _bad(tmp_path: Path, name: str, idx: bytes | None = None, bin_: bytes | None = None) -> str:
    write_megatron(str(tmp_path / f"{name}.idx"), [np.arange(4)] * 3, np.int32)
    if idx is not None:
        (tmp_path / f"{name}.idx").write_bytes(idx)
    if bin_ is not None:
        (tmp_path / f"{name}.bin").write_bytes(bin_)
    return str(tmp_path / f"{name}.idx")


def test_bad_pairs_are_refused_naming_the_file_and_the_fix(tmp_path: Path) -> None:
    url = _bad(tmp_path, "ok")
    good_idx = Path(url).read_bytes()
    good_bin = Path(url[:-4] + ".bin").read_bytes()
    cases = [
        (dict(idx=b"NOTANIDX" + good_idx[8:]), r"bad\.idx: not a Megatron index"),
        (dict(idx=good_idx[:20]), r"bad\.idx: truncated"),
        (dict(idx=good_idx[:-5]), r"bad\.idx: truncated: the index header declares"),
        (dict(bin_=good_bin[:-4]), r"bad\.bin: holds 44 bytes but its index says 48"),
        (dict(idx=good_idx[:17] + b"\x07" + good_idx[18:]), r"float32 values.*not token ids"),
        (dict(idx=good_idx[:17] + b"\x09" + good_idx[18:]), r"unknown Megatron dtype code 9"),
    ]
    for kw, message in cases:
        with pytest.raises(DataFileError, match=message):
            MegatronHandler().open(_bad(tmp_path, "bad", **kw))
    with pytest.raises(DataFileError, match=r"data\.npy: .*listed by its \.idx or \.bin"):
        MegatronHandler().open(str(tmp_path / "data.npy"))
    with pytest.raises(DataFileError, match="not found"):
        MegatronHandler().open(str(tmp_path / "missing.idx"))


def test_a_folder_lists_each_pair_once_and_is_sniffed(tmp_path: Path) -> None:
    for k in range(3):
        write_megatron(str(tmp_path / f"part{k}.idx"), [np.arange(3)] * (k + 1),
                      np.int32)  # fmt: skip
    for file_type in (None, "megatron"):
        ix = DatasetIndex.build(str(tmp_path), file_type=file_type)
        assert ix.file_type == "megatron"
        assert [f.rsplit("/", 1)[1] for f in ix.files] == ["part0.idx", "part1.idx", "part2.idx"]
        assert ix.total_docs == 6
    ix = DatasetIndex.build(str(tmp_path / "part1.bin"), file_type="megatron")
    assert ix.total_docs == 2
    assert isinstance(get_handler("megatron"), MegatronHandler)


def test_the_pipeline_delivers_every_document_once(tmp_path: Path) -> None:
    docs = documents(np.random.default_rng(5), 60, np.uint16)
    for name, part in (("a", docs[:35]), ("b", docs[35:])):
        (tmp_path / "web").mkdir(exist_ok=True)
        write_megatron(str(tmp_path / "web" / f"{name}.idx"), joined(part, np.uint16), np.uint16, 2)
    cfg = PipelineConfig(
        data_path=str(tmp_path), datasets="web", weights="1", file_type="megatron",
        eos_token=None, seq_length=32, logical_shards=4, batch_size=1, shuffle_buffer=1,
        epochs=1, min_length=1,
    )  # fmt: skip
    got = delivered_documents(build_pipeline(cfg, World(), collate=False))
    expected = collections.Counter(tuple(d.tolist()) for d in joined(docs, np.uint16) if len(d))
    assert got["web"] == expected


def test_remote_pairs_are_read_by_range_never_whole(s3: S3Endpoint) -> None:
    rng = np.random.default_rng(9)
    docs = [[rng.integers(1, 50000, size=2000).astype(np.uint16)] for _ in range(200)]
    prefix = s3.url("mega", "corpus")
    so = s3.storage_options
    with fsspec.open(prefix + ".bin", "wb", **so) as f:
        for d in docs:
            f.write(d[0].tobytes())
    seqs = len(docs)
    with fsspec.open(prefix + ".idx", "wb", **so) as f:
        f.write(INDEX_MAGIC + struct.pack("<QBQQ", 1, 8, seqs, seqs + 1))
        f.write(np.full(seqs, 2000, np.int32).tobytes())
        f.write((np.arange(seqs, dtype=np.int64) * 4000).tobytes())
        f.write(np.arange(seqs + 1, dtype=np.int64).tobytes())
    ix = DatasetIndex.build(s3.url("mega"), storage_options=so)
    assert ix.file_type == "megatron" and ix.total_docs == 200
    cache = ShardCache(storage_options=so)  # a default cache: downloads other formats whole
    try:
        access = FileAccess(ix, cache, prefetch=2)
        assert access.open(0, []) == 200
        for i in (7, 150, 3):
            assert np.array_equal(access.get(i), docs[i][0])
        stats = access.io_stats()
        access.close_all()
    finally:
        cache.close()
    assert stats["downloads"] == 0  # nothing fetched whole
    # the index's header and arrays, the .bin's ... and three documents of 4000 bytes
    assert stats["bytes_downloaded"] == 34 + 12 * seqs + 8 * (seqs + 1) + 3 * 4000
    assert stats["range_requests"] == 2 + 3


# -------------------------------------------------------------------------- Megatron's blends
def _two_datasets(root: Path) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(11)
    docs = {
        "wiki_text_document": [rng.integers(1, 999, size=20).astype(np.int32) for _ in range(30)],
        "code/py_text_document": [rng.integers(1, 999, size=10).astype(np.int32) for _ in range(20)],
    }  # fmt: skip
    for name, d in docs.items():
        write_megatron(str(root / f"{name}.idx"), d, np.int32)
    return docs


def test_a_weighted_blend_maps_to_datasets_and_token_weights(tmp_path: Path) -> None:
    docs = _two_datasets(tmp_path)
    a, b = str(tmp_path / "wiki_text_document"), str(tmp_path / "code/py_text_document")
    for blend in (f"0.3 {a} 0.7 {b}", ["0.3", a, "0.7", b], [0.3, a + ".idx", 0.7, b + ".bin"]):
        cfg = PipelineConfig.from_megatron(blend, seq_length=16, logical_shards=2, batch_size=1)
        assert cfg.data_path == str(tmp_path)
        assert cfg.datasets == ["wiki_text_document.idx", "code/py_text_document.idx"]
        assert cfg.weights == [0.3, 0.7]
        assert (cfg.file_type, cfg.eos_token) == ("megatron", None)
    # the config reads the documents the blend names
    cfg = PipelineConfig.from_megatron(
        f"1 {a} 1 {b}", seq_length=16, logical_shards=2, batch_size=1, shuffle_buffer=1,
        epochs=1,
    )  # fmt: skip
    got = delivered_documents(build_pipeline(cfg, World(), collate=False))
    for name, d in docs.items():
        assert got[f"{name}.idx"] == collections.Counter(tuple(x.tolist()) for x in d)


def test_a_blend_without_weights_weighs_datasets_by_their_tokens(tmp_path: Path) -> None:
    _two_datasets(tmp_path)
    a, b = str(tmp_path / "wiki_text_document"), str(tmp_path / "code/py_text_document")
    cfg = PipelineConfig.from_megatron([a, b])
    assert cfg.weights == [30 * 20.0, 20 * 10.0]  # one epoch of each, as Megatron builds it


def test_bad_blends_are_refused() -> None:
    with pytest.raises(ValueError, match=r"names \['a'\] more than once"):
        PipelineConfig.from_megatron("0.5 a 0.5 a")
    with pytest.raises(ValueError, match="data_path is empty"):
        PipelineConfig.from_megatron("")
    with pytest.raises(ValueError, match=r"\['weights'\] come from the Megatron data_path"):
        PipelineConfig.from_megatron("1 a", weights=[1])
