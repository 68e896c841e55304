"""The one-call Bamba-style pipeline: config, exact resume, every token exactly once."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch
from harness import check_restore_at_every_step, run

from torchdata_ext import World
from torchdata_ext.pipeline.build import build_datasets, build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.testing import write_arrow_batches, write_jsonl


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    rng = np.random.default_rng(2)
    for name, n_docs, mean in (("web", 120, 30), ("code", 60, 80), ("books", 10, 300)):
        docs = [
            rng.integers(5, 30_000, max(1, int(rng.exponential(mean))), dtype=np.uint32)
            for _ in range(n_docs)
        ]
        half = n_docs // 2
        write_arrow_batches(str(root / name / "part_0.arrow"), docs[:half])
        write_arrow_batches(str(root / name / "part_1.arrow"), docs[half:])
    return str(root)


def config(data_path: str, **kw) -> PipelineConfig:
    base = dict(
        data_path=data_path,
        datasets="web,code,books",
        weights="3,1,1",
        seq_length=64,
        eos_token=0,
        bos_token=1,
        logical_shards=4,
        batch_size=4,
        seed=9,
        shuffle_buffer=16,
        block_docs=8,
    )
    base.update(kw)
    return PipelineConfig(**base)


def test_batches_have_the_promised_shape(data_path) -> None:
    every = "input_ids,labels,position_ids,document_ids,loss_mask"
    node = build_pipeline(config(data_path, output_keys=every), World())
    batch = next(node)
    assert list(batch) == every.split(",")
    # by default what a Hugging Face causal LM with packed attention takes
    assert list(next(build_pipeline(config(data_path), World()))) == [
        "input_ids",
        "labels",
        "position_ids",
    ]
    with pytest.raises(ValueError, match="output_keys.*unknown.*attention_mask"):
        config(data_path, output_keys="input_ids,attention_mask")
    assert batch["input_ids"].shape == (4, 64) and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])


@pytest.mark.parametrize("mode", ["concat", "pad", "best_fit"])
def test_restore_at_every_step(data_path, mode) -> None:
    cfg = config(data_path, pack_mode=mode, best_fit_window=20, epochs=None)
    datasets = build_datasets(cfg)
    check_restore_at_every_step(lambda: build_pipeline(cfg, World(), datasets), max_steps=25)


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_one_epoch_delivers_every_token_exactly_once(data_path, mode) -> None:
    cfg = config(data_path, pack_mode=mode, epochs=1, best_fit_window=30)
    datasets = build_datasets(cfg)
    coverage: dict[tuple, np.ndarray] = {}
    for w in range(2):
        node = build_pipeline(cfg, World(0, 1, w, 2), datasets, collate=False)
        for seq in run(node):
            ids = seq["input_ids"]
            full = np.concatenate([ids, seq["labels"][-1:]]) if "labels" in seq else ids
            pos = 0
            pack = node.source  # the shuffle buffer's source
            for ds, f, d, start, length in seq["provenance"].tolist():
                if ds not in (LITERAL, PAD):
                    key = (pack.dataset_names[ds], f, d)
                    doc = pack.fetch_document(*key)
                    coverage.setdefault(key, np.zeros(len(doc), np.int64))[
                        start : start + length
                    ] += 1
                    np.testing.assert_array_equal(
                        full[pos : pos + length], doc[start : start + length]
                    )
                pos += length
    total_docs = sum(ix.total_docs for ix in datasets.values())
    assert len(coverage) == total_docs
    assert all((c == 1).all() for c in coverage.values())


def test_token_mix_follows_weights(data_path) -> None:
    cfg = config(data_path, shuffle_buffer=1, epochs=None, seq_length=512)
    node = build_pipeline(cfg, World(), collate=False)
    share: collections.Counter = collections.Counter()
    for seq in run(node, 1000):
        for ds, *_, length in seq["provenance"].tolist():
            if ds >= 0:
                share[ds] += length
    names = node.dataset_names
    total = sum(share.values())
    got = {names[k]: v / total for k, v in share.items()}
    for name, w in {"web": 0.6, "code": 0.2, "books": 0.2}.items():
        # the rule keeps each share within (longest documents) / (tokens so far): ~0.5% here
        assert abs(got[name] - w) < 0.01, got


def test_text_pipeline_with_byte_tokenizer(tmp_path) -> None:
    texts = [f"document {i}: " + "lorem ipsum " * (i % 7) for i in range(40)]
    write_jsonl(str(tmp_path / "prose" / "a.jsonl"), texts[:20])
    write_jsonl(str(tmp_path / "prose" / "b.jsonl"), texts[20:])
    cfg = PipelineConfig(
        data_path=str(tmp_path), datasets="prose", file_type="jsonl", col_name="text",
        tokenizer="byte", seq_length=32, eos_token=0, bos_token=None, logical_shards=4,
        batch_size=2, shuffle_buffer=1, epochs=1,
    )  # fmt: skip
    seqs = run(build_pipeline(cfg, World(), collate=False))
    tokens = np.concatenate([np.concatenate([s["input_ids"], s["labels"][-1:]]) for s in seqs])
    # "byte" is byte b -> id b + 1 (as in prepare), so EOS 0 ends every document and is no byte
    docs = bytes(int(t) - 1 if t else 0 for t in tokens).split(b"\0")
    assert sorted(d.decode() for d in docs if d) == sorted(texts)


def test_config_files_and_errors(data_path, tmp_path) -> None:
    cfg = config(data_path)
    (tmp_path / "c.json").write_text(json.dumps(cfg.to_dict()))
    assert PipelineConfig.from_file(str(tmp_path / "c.json")) == cfg
    (tmp_path / "c.yaml").write_text(
        f"data_path: {data_path}\ndatasets: web,code\nweights: [2, 1]\nseq_length: 128\nstrip_tokens: '0,1'\n"
    )
    y = PipelineConfig.from_file(str(tmp_path / "c.yaml"))
    assert y.datasets == ["web", "code"] and y.weights == [2.0, 1.0] and y.strip_tokens == [0, 1]
    with pytest.raises(ValueError, match="unknown config keys \\['seq_len'\\]"):
        PipelineConfig.from_dict({"data_path": "x", "seq_len": 5})
    with pytest.raises(ValueError, match="2 weights for 3 datasets"):
        PipelineConfig(data_path="x", datasets="a,b,c", weights="1,2")
    with pytest.raises(ValueError, match="seq_length=0"):
        PipelineConfig(data_path="x", seq_length=0)
    with pytest.raises(ValueError, match="data_path is empty"):
        PipelineConfig()
    with pytest.raises(FileNotFoundError, match="tokenizer='nope.json'"):
        build_pipeline(config(data_path, tokenizer="nope.json"), World())
