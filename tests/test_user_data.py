"""Data a user brings: a Hugging Face ``save_to_disk`` folder read without ``file_type``; what
``prepare`` records about its tokenizer (an absolute path and its hash, so ``inspect`` run
elsewhere decodes and a different tokenizer is refused); and the token dtype ``prepare`` picks
(the smallest that holds the vocabulary), read back by every reader."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import torchdata_ext
from torchdata_ext import World
from torchdata_ext.nodes.reader import ShardReader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.testing import write_jsonl

tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["w1 w2 w7999", "w5 w5", "w4000 w3 w2 w1", "w7998"]


def vocab_tokenizer(path: Path, size: int) -> Path:
    """A word-level tokenizer of ``size`` ids: word ``w<i>`` is id ``i``, id 0 its special
    ``</s>`` (the EOS)."""
    vocab = {"</s>": 0, **{f"w{i}": i for i in range(1, size)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="</s>"))
    tok.add_special_tokens(["</s>"])
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path))
    return path


def expected(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


# -- save_to_disk ----------------------------------------------------------------------------
@pytest.mark.parametrize("as_dict", [False, True])
def test_a_save_to_disk_folder_reads_without_file_type(tmp_path: Path, as_dict) -> None:
    datasets = pytest.importorskip("datasets")
    docs = [[5, 6, 7], [8], [9, 10]]
    ds = datasets.Dataset.from_dict({"tokens": docs})
    folder = tmp_path / "hf"
    (datasets.DatasetDict({"train": ds}) if as_dict else ds).save_to_disk(str(folder))
    index = DatasetIndex.build(str(folder))  # file_type=None: chosen by suffix
    assert [os.path.basename(f) for f in index.files] == ["data-00000-of-00001.arrow"]
    assert index.file_type == "arrow" and index.total_docs == 3
    reader = ShardReader(index, 1, world=World(0, 1, 0, 1), epochs=1)
    reader.reset()
    got = sorted(d.data.tolist() for b in reader for d in b)
    assert got == sorted(docs)
    cfg = PipelineConfig(
        data_path=str(folder), file_type=None, seq_length=4, logical_shards=1, batch_size=1,
        shuffle_buffer=1, epochs=1, eos_token=None, shift=False,
    )  # fmt: skip
    node = build_pipeline(cfg, World(0, 1, 0, 1))
    node.reset()
    tokens = [x for b in node for x in b["input_ids"].reshape(-1).tolist()]
    assert sorted(x for x in tokens if x) == [5, 6, 7, 8, 9, 10]  # 0: the padding


# -- the tokenizer recorded ------------------------------------------------------------------
def test_prepare_records_the_tokenizer_absolutely_and_inspect_decodes_elsewhere(
    tmp_path: Path, monkeypatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    vocab_tokenizer(work / "tok.json", 8000)
    write_jsonl(str(work / "in.jsonl"), TEXTS)
    monkeypatch.chdir(work)
    torchdata_ext.prepare("in.jsonl", "out", tokenizer="tok.json", progress=False)  # relative
    meta = json.loads((work / "out" / "meta" / "torchdata_ext_meta.json").read_text())
    assert meta["tokenizer"] == str(work / "tok.json")
    assert len(meta["tokenizer_sha256"]) == 16
    monkeypatch.chdir(tmp_path)  # elsewhere: the relative name would not be found
    result = torchdata_ext.inspect_dataset(str(work / "out"), doc=2, out=io.StringIO())
    assert result["tokens"] == expected(TEXTS[2]) and result["text"] == TEXTS[2]


def test_inspect_refuses_another_tokenizer(tmp_path: Path) -> None:
    vocab_tokenizer(tmp_path / "tok.json", 8000)
    vocab_tokenizer(tmp_path / "other.json", 9000)
    write_jsonl(str(tmp_path / "in.jsonl"), TEXTS)
    out = tmp_path / "out"
    torchdata_ext.prepare(str(tmp_path / "in.jsonl"), str(out),
                          tokenizer=str(tmp_path / "tok.json"), progress=False)  # fmt: skip
    meta = json.loads((out / "meta" / "torchdata_ext_meta.json").read_text())
    other = str(tmp_path / "other.json")
    with pytest.raises(ValueError) as info:
        torchdata_ext.inspect_dataset(str(out), doc=0, tokenizer=other, out=io.StringIO())
    msg = str(info.value)
    assert msg.startswith(f"tokenizer={other!r} (sha256 ")
    assert msg.endswith(
        f"is not the tokenizer the data was prepared with, {str(tmp_path / 'tok.json')!r} "
        f"(sha256 {meta['tokenizer_sha256']}) ({out / 'meta' / 'torchdata_ext_meta.json'}): it "
        "would decode the tokens into the wrong text; pass that tokenizer (and byte_offset), or "
        "none to use the recorded one"
    )
    with pytest.raises(ValueError, match=r"tokenizer='byte' \(byte_offset=1\) is not the"):
        torchdata_ext.inspect_dataset(str(out), doc=0, tokenizer="byte", out=io.StringIO())


# -- the token dtype -------------------------------------------------------------------------
def stored_dtype(out: Path, fmt: str) -> str:
    """The token dtype of the one output file, as stored."""
    if fmt == "arrow":
        (path,) = out.glob("part*.arrow")
        return str(pa.ipc.open_file(pa.memory_map(str(path))).schema.field("tokens").type)
    if fmt == "npy":
        (path,) = out.glob("part*.npy")
        return str(np.load(path).dtype)
    index = json.loads((out / "index.json").read_text())
    return index["shards"][0]["column_encodings"][0]


@pytest.mark.parametrize("fmt", ["arrow", "npy", "mds"])
def test_prepare_stores_an_8000_token_vocabulary_as_uint16_and_it_reads_back(
    tmp_path: Path, fmt
) -> None:
    tok = vocab_tokenizer(tmp_path / "tok.json", 8000)
    write_jsonl(str(tmp_path / "in.jsonl"), TEXTS)
    out = tmp_path / "out"
    torchdata_ext.prepare(str(tmp_path / "in.jsonl"), str(out), format=fmt, eos_token=0,
                          tokenizer=str(tok), progress=False)  # fmt: skip
    meta = json.loads((out / "meta" / "torchdata_ext_meta.json").read_text())
    assert (meta["dtype"], meta["vocab_size"]) == ("uint16", 8000)
    assert (
        stored_dtype(out, fmt) == {"arrow": "uint16", "npy": "uint16", "mds": "ndarray:uint16"}[fmt]
    )
    want = sorted(expected(t) + [0] for t in TEXTS)
    # the pipeline's reader, through the metadata's checks
    cfg = PipelineConfig(
        data_path=str(out), file_type="flat" if fmt == "npy" else fmt, seq_length=4,
        logical_shards=1, batch_size=1, shuffle_buffer=1, epochs=1, eos_token=0, shift=False,
        pad_token=8001,
    )  # fmt: skip
    node = build_pipeline(cfg, World(0, 1, 0, 1), collate=False)
    node.reset()
    flat = [x for item in node for x in item["input_ids"].tolist() if x != 8001]
    docs, cur = [], []
    for x in flat:
        cur.append(x)
        if x == 0:
            docs.append(cur)
            cur = []
    assert sorted(docs) == want
    # inspect decodes with the recorded tokenizer
    result = torchdata_ext.inspect_dataset(str(out), doc=1, out=io.StringIO())
    assert result["tokens"][:-1] in [expected(t) for t in TEXTS]
    assert result["text"] in TEXTS


def test_the_byte_tokenizer_is_stored_as_uint16_and_a_dtype_can_be_forced(tmp_path: Path) -> None:
    write_jsonl(str(tmp_path / "in.jsonl"), ["héllo", "x"])
    torchdata_ext.prepare(str(tmp_path / "in.jsonl"), str(tmp_path / "a"), format="npy",
                          progress=False)  # fmt: skip
    assert np.load(next((tmp_path / "a").glob("part*.npy"))).dtype == np.uint16
    torchdata_ext.prepare(str(tmp_path / "in.jsonl"), str(tmp_path / "b"), format="npy",
                          dtype="uint32", progress=False)  # fmt: skip
    assert np.load(next((tmp_path / "b").glob("part*.npy"))).dtype == np.uint32
    big = vocab_tokenizer(tmp_path / "big.json", 70_000)
    with pytest.raises(ValueError) as info:
        torchdata_ext.prepare(str(tmp_path / "in.jsonl"), str(tmp_path / "c"), dtype="uint16",
                              tokenizer=str(big), progress=False)  # fmt: skip
    assert str(info.value) == (
        "dtype='uint16' cannot store the tokens: ids go up to 69999 (vocab_size=70000); use "
        "one of ['uint32'], or dtype=None for the smallest"
    )
    assert not (tmp_path / "c").exists()
