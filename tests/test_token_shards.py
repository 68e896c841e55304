"""llm.c and nanoGPT token shards, written here exactly as those projects' scripts write them
(llm.c ``dev/data/data_common.py`` ``write_datafile`` with ``[eot] + tokens`` per document;
nanoGPT ``data/openwebtext/prepare.py``: ``tokens + [eot]`` per document into a ``uint16``
``np.memmap``), read back by ``file_type`` and by sniffing, through the handler and the pipeline."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
from harness import delivered_documents

from torchdata_ext import DataFileError, DatasetIndex, PipelineConfig, World, build_pipeline
from torchdata_ext.handlers import FlatTokenHandler, LlmcHandler, NanoGptHandler, get_handler

EOT = 50256  # GPT-2's <|endoftext|>


def texts(rng: np.random.Generator, n: int, high: int = 50256) -> list[np.ndarray]:
    """``n`` tokenized documents of 1..30 tokens, never the EOT, values up to ``high``."""
    return [rng.integers(0, high, size=int(rng.integers(1, 31))) for _ in range(n)]


def write_llmc(path: Path, docs: list[np.ndarray], llama: bool = False) -> None:
    """As llm.c's fineweb.py + write_datafile: each document ``[eot] + tokens``, a 256-int32
    header (magic, version, token count), then the tokens (uint16 GPT-2, uint32 Llama 3)."""
    toks = np.concatenate([np.concatenate([[EOT], d]) for d in docs])
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1] = (20240801, 7) if llama else (20240520, 1)
    header[2] = len(toks)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(toks.astype(np.uint32 if llama else np.uint16).tobytes())


def write_nanogpt(path: Path, docs: list[np.ndarray]) -> None:
    """As nanoGPT's openwebtext prepare.py: ``ids + [eot]`` per document into a uint16 memmap."""
    ids = [np.concatenate([d, [EOT]]).astype(np.uint16) for d in docs]
    arr = np.memmap(path, dtype=np.uint16, mode="w+", shape=(sum(len(x) for x in ids),))
    idx = 0
    for x in ids:
        arr[idx : idx + len(x)] = x
        idx += len(x)
    arr.flush()
    del arr


def _read(handler: FlatTokenHandler, url: str) -> list[list[int]]:
    reader = handler.open(url)
    out = [handler.get(reader, i).tolist() for i in range(handler.length(reader))]
    handler.close(reader)
    return out


@pytest.mark.parametrize("llama", [False, True], ids=["gpt2-uint16", "llama3-uint32"])
def test_llmc_shards_split_at_the_eot(tmp_path: Path, llama: bool) -> None:
    docs = texts(np.random.default_rng(int(llama)), 25, high=128_000 if llama else 50256)
    path = tmp_path / "fineweb_train_000001.bin"
    write_llmc(path, docs, llama)
    # each document, then the EOT llm.c wrote before the next one (the last has none)
    expected = [[*d.tolist(), EOT] for d in docs[:-1]] + [docs[-1].tolist()]
    reader = LlmcHandler(eos_token=EOT).open(str(path))
    assert reader.kind == "llmc" and reader.tokens.dtype == (np.uint32 if llama else np.uint16)
    assert _read(LlmcHandler(eos_token=EOT), str(path)) == expected
    # sniffed: a .bin read as flat (uint32 by default) whose header is llm.c's
    assert _read(FlatTokenHandler(eos_token=EOT), str(path)) == expected
    ix = DatasetIndex.build(str(tmp_path), eos_token=EOT)
    assert (ix.file_type, ix.total_docs) == ("flat", 25)


def test_nanogpt_shards_split_after_the_eot(tmp_path: Path) -> None:
    docs = texts(np.random.default_rng(2), 30)
    write_nanogpt(tmp_path / "train.bin", docs)
    expected = [[*d.tolist(), EOT] for d in docs]
    assert _read(NanoGptHandler(eos_token=EOT), str(tmp_path / "train.bin")) == expected
    assert isinstance(get_handler("nanogpt", eos_token=EOT), NanoGptHandler)
    ix = DatasetIndex.build(str(tmp_path / "train.bin"), file_type="nanogpt", eos_token=EOT)
    assert ix.total_docs == 30


@pytest.mark.parametrize("file_type", ["llmc", "nanogpt"])
def test_the_pipeline_delivers_every_document_once(tmp_path: Path, file_type: str) -> None:
    docs = texts(np.random.default_rng(3), 40)
    (tmp_path / "web").mkdir()
    for k in range(2):
        write = write_llmc if file_type == "llmc" else write_nanogpt
        write(tmp_path / "web" / f"shard_{k}.bin", docs[k::2])
    cfg = PipelineConfig(
        data_path=str(tmp_path), datasets="web", weights="1", file_type=file_type,
        eos_token=EOT, seq_length=32, logical_shards=4, batch_size=1, shuffle_buffer=1,
        epochs=1, min_length=1,
    )  # fmt: skip
    got = delivered_documents(build_pipeline(cfg, World(), collate=False))
    # every document with the EOT after it in the file: in an llm.c shard the last document
    # has none (the pipeline adds one, as a literal token: tests/test_special_tokens.py)
    expected = collections.Counter((*d.tolist(), EOT) for d in docs)
    if file_type == "llmc":
        for last in docs[-2:]:
            expected[(*last.tolist(), EOT)] -= 1
            expected[tuple(last.tolist())] += 1
    assert got["web"] == +expected


def test_bad_llmc_shards_are_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    write_llmc(path, texts(np.random.default_rng(4), 3))
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(DataFileError, match=r"s\.bin: not an llm\.c token shard \(the header says"):
        LlmcHandler(eos_token=EOT).open(str(path))
    # a truncated shard no longer sniffs as llm.c: read as flat it is refused for its size
    with pytest.raises(DataFileError, match=r"s\.bin: the file holds \d+ bytes, not a multiple"):
        FlatTokenHandler(eos_token=EOT).open(str(path))
    write_nanogpt(path, texts(np.random.default_rng(5), 60))  # more than 1024 bytes
    with pytest.raises(DataFileError, match=r"header magic .*file_type='nanogpt'"):
        LlmcHandler(eos_token=EOT).open(str(path))
    with pytest.raises(DataFileError, match="no eos_token"):
        NanoGptHandler().open(str(path))
