"""Mosaic MDS: shards as mosaicml-streaming encodes them, ``prepare --format mds``, the index,
exact documents through the reader and the pipeline, restore at every step, clear errors.

``mosaicml-streaming`` itself does not install here (it pins ``numpy<2.2``), so the format is
tested against its specification: ``SHARD_OF_STREAMING`` below is a shard whose every sample was
encoded by ``mosaicml-streaming`` 0.13.0's own ``mds_encode`` (``streaming/base/format/mds/
encodings.py``, run from the unpacked wheel) and laid out as its ``MDSWriter`` lays out a shard;
``encode_mds_shard`` produces byte-identical shards for the same samples (checked then; here
for this one).
"""

from __future__ import annotations

import base64
import json
import posixpath
from pathlib import Path

import numpy as np
import pytest
from harness import check_restore_at_every_step, item_key, run

import torchdata_ext
from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.handlers import DataFileError, MdsHandler, handler_for_url
from torchdata_ext.handlers.mds_writer import encode_mds_shard
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.testing import write_jsonl, write_mds

# columns dyn: ndarray (dtype and shape per sample), text: str, tokens: ndarray:uint32, uid: int
SHARD_OF_STREAMING = base64.b64decode(
    "AwAAAAgBAAA8AQAAWwEAAJkBAAB7ImNvbHVtbl9lbmNvZGluZ3MiOiBbIm5kYXJyYXkiLCAic3RyIiwgIm5kYXJy"
    "YXk6dWludDMyIiwgImludCJdLCAiY29sdW1uX25hbWVzIjogWyJkeW4iLCAidGV4dCIsICJ0b2tlbnMiLCAidWlk"
    "Il0sICJjb2x1bW5fc2l6ZXMiOiBbbnVsbCwgbnVsbCwgbnVsbCwgOF0sICJjb21wcmVzc2lvbiI6IG51bGwsICJm"
    "b3JtYXQiOiAibWRzIiwgImhhc2hlcyI6IFtdLCAic2l6ZV9saW1pdCI6IDY3MTA4ODY0LCAidmVyc2lvbiI6IDJ9"
    "DAAAAAYAAAAOAAAAEQgCAgEAAgADAAQAaMOpbGxvBAMFAAAAcBEBAAMAAAALAAAAAAAAAAUAAAAAAAAABgAAABEE"
    "ASwBBAEJAAAA/v////////8JAAAABwAAABoAAAARBAP//wAAAQDml6XmnKwKBAYBAAAAAgAAAAMAAAAEAAAABQAA"
    "AAYAAAAHAAAAAAAAAA=="
)
STREAMING_SAMPLES = [
    {"tokens": [5, 70000, 3], "uid": 11, "text": "héllo", "dyn": [[1, 2], [3, 4]]},
    {"tokens": [9], "uid": -2, "text": "", "dyn": [300]},
    {"tokens": [1, 2, 3, 4, 5, 6], "uid": 7, "text": "日本\n", "dyn": [-1, 0, 1]},
]


def _read(handler: MdsHandler, url: str) -> list:
    reader = handler.open(url)
    try:
        return [handler.get(reader, i) for i in range(handler.length(reader))]
    finally:
        handler.close(reader)


def test_a_shard_encoded_by_mosaicml_streaming_reads_exactly(tmp_path: Path) -> None:
    url = str(tmp_path / "shard.00000.mds")
    Path(url).write_bytes(SHARD_OF_STREAMING)
    assert isinstance(handler_for_url(url), MdsHandler)
    tokens = _read(MdsHandler(), url)
    assert [t.tolist() for t in tokens] == [s["tokens"] for s in STREAMING_SAMPLES]
    assert all(t.dtype == np.uint32 for t in tokens)
    assert _read(MdsHandler(col_name="text"), url) == [s["text"] for s in STREAMING_SAMPLES]
    dyn = _read(MdsHandler(col_name="dyn"), url)  # int16 arrays, read flattened
    assert [d.tolist() for d in dyn] == [np.ravel(s["dyn"]).tolist() for s in STREAMING_SAMPLES]
    assert all(d.dtype == np.int16 for d in dyn)
    # our writer lays the same samples out byte for byte as streaming's writer did
    columns = {"tokens": "ndarray:uint32", "uid": "int", "text": "str", "dyn": "ndarray"}
    samples = [
        {**s, "tokens": np.array(s["tokens"], np.uint32), "dyn": np.array(s["dyn"], np.int16)}
        for s in STREAMING_SAMPLES
    ]
    ours = encode_mds_shard(samples, columns)
    theirs = SHARD_OF_STREAMING.replace(b'"size_limit": 67108864', b'"size_limit": null')
    n_head = 4 + 4 * 4  # the offsets shift by the shorter config: compare after them
    assert ours[n_head:] == theirs[n_head:]


def test_documents_are_zero_copy_views_of_the_mapped_shard(tmp_path: Path) -> None:
    docs = write_mds(str(tmp_path), [np.arange(100, dtype=np.uint32)] * 3)
    handler = MdsHandler()
    reader = handler.open(str(tmp_path / "shard.00000.mds"))
    got = handler.get_many(reader, [0, 2])
    assert all(np.shares_memory(g, np.frombuffer(reader.data, np.uint8)) for g in got)
    assert all(np.array_equal(g, docs[0]) for g in got)
    assert handler.doc_lengths(reader).tolist() == [100, 100, 100]


def test_errors_name_the_file_the_column_and_the_fix(tmp_path: Path) -> None:
    url = str(tmp_path / "shard.00000.mds")
    Path(url).write_bytes(SHARD_OF_STREAMING)
    with pytest.raises(DataFileError, match=r"no column 'input_ids'.*'tokens': 'ndarray:uint32'"):
        MdsHandler(col_name="input_ids").open(url)
    with pytest.raises(DataFileError, match=r"column 'uid' has encoding 'int'.*col_name"):
        MdsHandler(col_name="uid").open(url)
    write_mds(str(tmp_path / "b"), [[1, 2]], encoding="bytes")
    with pytest.raises(DataFileError, match=r"raw bytes: pass bytes_dtype='int64'"):
        MdsHandler().open(str(tmp_path / "b" / "shard.00000.mds"))
    odd = str(tmp_path / "odd.mds")
    Path(odd).write_bytes(encode_mds_shard([{"tokens": b"abc"}], {"tokens": "bytes"}))
    with pytest.raises(DataFileError, match=r"odd\.mds: sample 0.*3 bytes, not a whole number"):
        MdsHandler(bytes_dtype="int64").open(odd)
    floats = str(tmp_path / "f.mds")
    Path(floats).write_bytes(
        encode_mds_shard([{"tokens": np.ones(3, np.float32)}], {"tokens": "ndarray"})
    )
    with pytest.raises(DataFileError, match=r"float32 arrays, not integer token ids"):
        MdsHandler().open(floats)
    with pytest.raises(ValueError, match=r"bytes_dtype='float32' must be an integer dtype"):
        MdsHandler(bytes_dtype="float32")
    broken = str(tmp_path / "broken.mds")
    Path(broken).write_bytes(SHARD_OF_STREAMING[:40])
    with pytest.raises(DataFileError, match=r"broken\.mds: .*truncated"):
        MdsHandler().open(broken)


def test_the_index_lists_shards_not_index_json_nor_both_copies(tmp_path: Path) -> None:
    folder = tmp_path / "mds"
    write_mds(str(folder), [[i, i + 1] for i in range(10)], docs_per_shard=4)
    write_mds(str(tmp_path / "z"), [[i, i + 1] for i in range(10)], docs_per_shard=4,
              compression="zstd")  # fmt: skip
    for p in sorted((tmp_path / "z").glob("shard*")):  # a streaming cache keeps both copies
        (folder / p.name).write_bytes(p.read_bytes())
    index = DatasetIndex.build(str(folder))  # format chosen by suffix: index.json is left out
    assert index.file_type == "mds"
    assert [posixpath.basename(f) for f in index.files] == [
        "shard.00000.mds", "shard.00001.mds", "shard.00002.mds",
    ]  # fmt: skip
    assert index.doc_counts.tolist() == [4, 4, 2] and index.total_tokens == 20
    zst = DatasetIndex.build(str(tmp_path / "z"))
    assert [posixpath.basename(f) for f in zst.files][0] == "shard.00000.mds.zstd"
    assert zst.total_tokens == 20


TEXTS = [f"doc {i} " + "é" * (i % 5) + "ab" * (i % 7) for i in range(45)]


def _tok(text: str) -> list[int]:
    return [b + 1 for b in text.encode("utf-8")]  # prepare's byte tokenizer


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prep")
    write_jsonl(str(root / "in" / "a.jsonl"), TEXTS[:30])
    write_jsonl(str(root / "in" / "b.jsonl"), TEXTS[30:])
    res = torchdata_ext.prepare(str(root / "in"), str(root / "web"), format="mds",
                                max_tokens_per_file=200, progress=False)  # fmt: skip
    assert res.documents == len(TEXTS) and len(res.outputs) > 3
    return root


def test_prepare_writes_mds_shards_and_their_index_json(prepared: Path) -> None:
    out = prepared / "web"
    shards = sorted(out.glob("*.mds"))
    index = json.loads((out / "index.json").read_text())
    assert index["version"] == 2
    assert [s["raw_data"]["basename"] for s in index["shards"]] == [p.name for p in shards]
    assert [s["raw_data"]["bytes"] for s in index["shards"]] == [p.stat().st_size for p in shards]
    for entry in index["shards"]:
        assert entry["column_names"] == ["tokens"]
        assert entry["column_encodings"] == ["ndarray:uint16"] and entry["zip_data"] is None
    docs = [d.tolist() for p in shards for d in _read(MdsHandler(), str(p))]
    assert docs == [_tok(t) for t in TEXTS]  # in input order, no EOS added
    assert sum(s["samples"] for s in index["shards"]) == len(TEXTS)


def test_the_cli_prepares_mds(tmp_path: Path) -> None:
    from torchdata_ext.cli import main

    write_jsonl(str(tmp_path / "in.jsonl"), ["one", "two"])
    assert main(["prepare", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o"),
                 "--format", "mds", "--no-progress"]) == 0  # fmt: skip
    docs = _read(MdsHandler(), str(tmp_path / "o" / "part00000_00000.mds"))
    assert [d.tolist() for d in docs] == [_tok("one"), _tok("two")]
    assert (tmp_path / "o" / "index.json").exists()


def test_the_reader_delivers_exactly_the_prepared_documents(prepared: Path) -> None:
    index = DatasetIndex.build(str(prepared / "web"))
    got = []
    for w in range(2):
        reader = ShardReader(index, 6, world=World(0, 1, w, 2), epochs=1, block_docs=4, seed=5)
        got += [d.data.tolist() for b in run(reader) for d in b]
    assert sorted(got) == sorted(_tok(t) for t in TEXTS)


def test_the_pipeline_delivers_exactly_the_prepared_documents(prepared: Path) -> None:
    cfg = PipelineConfig(
        data_path=str(prepared), datasets="web", weights="1", file_type="mds",
        seq_length=24, eos_token=0, logical_shards=4, batch_size=2, shuffle_buffer=8,
        epochs=1, seed=3,
    )  # fmt: skip
    seen: dict[tuple, dict[int, list[int]]] = {}  # (file, doc) -> start -> tokens
    for w in range(2):
        node = build_pipeline(cfg, World(0, 1, w, 2), collate=False)
        for seq in run(node):
            full = np.concatenate([seq["input_ids"], seq["labels"][-1:]])
            pos = 0
            for ds, f, d, start, length in seq["provenance"].tolist():
                if ds not in (LITERAL, PAD):
                    piece = full[pos : pos + length].tolist()
                    assert seen.setdefault((f, d), {}).setdefault(start, piece) is piece
                pos += length
    docs = [sum((p[k] for k in sorted(p)), []) for p in seen.values()]
    assert sorted(docs) == sorted(_tok(t) for t in TEXTS)  # each piece once, nothing missing


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("kind", ["tokens", "text"])
def test_restore_at_every_step_over_mds(tmp_path: Path, compression, kind) -> None:
    rng = np.random.default_rng(4)
    if kind == "text":
        docs: list = [TEXTS[i] for i in range(30)]
        write_mds(str(tmp_path), docs, col_name="text", encoding="str", docs_per_shard=11,
                  compression=compression)  # fmt: skip
        options = {"col_name": "text"}
    else:
        docs = [rng.integers(1, 500, int(rng.integers(1, 20))) for _ in range(30)]
        write_mds(str(tmp_path), docs, docs_per_shard=11, compression=compression,
                  encoding="ndarray")  # fmt: skip
        options = {}
    index = DatasetIndex.build(str(tmp_path), handler_options=options)
    assert len(index.files) == 3

    def make() -> ShardReader:
        return ShardReader(index, 4, world=World(), epochs=2, block_docs=3, seed=2)

    items = check_restore_at_every_step(make)
    got = [d.data for b in items if b.epoch == 0 for d in b]
    if kind == "text":
        assert sorted(got) == sorted(docs)
    else:
        assert sorted(g.tolist() for g in got) == sorted(d.tolist() for d in docs)
    assert [item_key(b) for b in items] == [item_key(b) for b in run(make())]


def test_mds_and_its_index_json_on_s3_read_through_the_cache(s3, tmp_path: Path) -> None:
    from torchdata_ext.remote import ShardCache

    rng = np.random.default_rng(8)
    docs = [rng.integers(1, 9000, int(rng.integers(1, 30))) for _ in range(25)]
    so = s3.storage_options
    write_mds(s3.url("mds"), docs, docs_per_shard=10, compression="zstd", storage_options=so)
    index = DatasetIndex.build(s3.url("mds"), storage_options=so)
    assert [posixpath.basename(f) for f in index.files] == [
        f"shard.{k:05d}.mds.zstd" for k in range(3)
    ]
    cache = ShardCache(tmp_path / "cache")
    reader = ShardReader(index, 4, world=World(), epochs=1, cache=cache, seed=1)
    got = [d.data.tolist() for b in run(reader) for d in b]
    assert sorted(got) == sorted(d.tolist() for d in docs)
    assert reader.io_stats()["downloads"] == 3


def test_inspect_reads_a_prepared_mds_folder(prepared: Path) -> None:
    import io

    summary = torchdata_ext.inspect_dataset(str(prepared / "web"), out=io.StringIO())
    assert summary["documents"] == len(TEXTS)
    assert summary["tokens"] == sum(len(_tok(t)) for t in TEXTS)
    one = torchdata_ext.inspect_dataset(str(prepared / "web"), doc=7, tokenizer="byte",
                                        out=io.StringIO())  # fmt: skip
    assert one["text"] == TEXTS[7]
