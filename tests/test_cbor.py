"""CBOR records (epochraft's layout): exact documents through the pipeline, restore at every
step, and errors naming the record and field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from harness import check_restore_at_every_step, run

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.handlers import CborHandler, DataFileError, handler_for_url
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.testing import write_cbor

cbor2 = pytest.importorskip("cbor2")

TEXTS = [f"record {i}: " + "日本 " * (i % 4) + "x" * (i % 9) for i in range(40)]


def test_records_written_by_cbor2_dump_one_after_another(tmp_path: Path) -> None:
    url = str(tmp_path / "shard.cbor")
    with open(url, "wb") as f:  # as epochraft's users write them
        for i, text in enumerate(TEXTS[:5]):
            cbor2.dump({"text": text, "meta": {"i": i, "tags": ["a", None]}}, f)
    handler = handler_for_url(url)
    assert isinstance(handler, CborHandler)
    reader = handler.open(url)
    assert [handler.get(reader, i) for i in range(handler.length(reader))] == TEXTS[:5]
    assert handler.doc_lengths(reader).tolist() == [len(t) for t in TEXTS[:5]]


def test_errors_name_the_record_and_the_field(tmp_path: Path) -> None:
    url = str(tmp_path / "a.cbor")
    Path(url).write_bytes(cbor2.dumps({"text": "ok"}) + cbor2.dumps({"body": "no text"}))
    with pytest.raises(DataFileError, match=r"a\.cbor: record 1 has no field 'text'.*'body'"):
        CborHandler().open(url)
    Path(url).write_bytes(cbor2.dumps(["not", "a", "map"]))
    with pytest.raises(DataFileError, match=r"record 0 is a CBOR list, not a map"):
        CborHandler().open(url)
    Path(url).write_bytes(cbor2.dumps({"text": "a"}) + cbor2.dumps({"text": [1, 2]}))
    with pytest.raises(DataFileError, match=r"text in some records and tokens in others"):
        CborHandler().open(url)
    Path(url).write_bytes(cbor2.dumps({"text": 3.5}))
    with pytest.raises(DataFileError, match=r"field 'text' is a float"):
        CborHandler().open(url)


def test_the_pipeline_tokenizes_cbor_text_exactly(tmp_path: Path) -> None:
    write_cbor(str(tmp_path / "chat" / "a.cbor"), TEXTS[:25])
    write_cbor(str(tmp_path / "chat" / "b.cbor.gz"), TEXTS[25:])
    cfg = PipelineConfig(
        data_path=str(tmp_path), datasets="chat", file_type="cbor", col_name="text",
        tokenizer="byte", seq_length=32, eos_token=0, bos_token=None, logical_shards=4,
        batch_size=2, shuffle_buffer=1, epochs=1,
    )  # fmt: skip
    pieces: dict[tuple, dict[int, list[int]]] = {}  # (file, doc) -> start -> token ids
    for seq in run(build_pipeline(cfg, World(), collate=False)):
        full = np.concatenate([seq["input_ids"], seq["labels"][-1:]])
        pos = 0
        for ds, f, d, start, length in seq["provenance"].tolist():
            if ds not in (LITERAL, PAD):
                pieces.setdefault((f, d), {})[start] = full[pos : pos + length].tolist()
            pos += length
    ids = [sum((p[k] for k in sorted(p)), []) for p in pieces.values()]
    texts = [bytes(b - 1 for b in doc).decode() for doc in ids]  # byte b is id b + 1
    assert sorted(texts) == sorted(TEXTS)


def test_restore_at_every_step_over_cbor_tokens(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 1000, int(rng.integers(0, 15))) for _ in range(30)]
    write_cbor(str(tmp_path / "a.cbor"), docs[:17], field="input_ids")
    write_cbor(str(tmp_path / "b.cbor.zst"), docs[17:], field="input_ids")
    index = DatasetIndex.build(str(tmp_path), col_name="input_ids")
    assert index.file_type == "cbor" and index.total_tokens == sum(len(d) for d in docs)

    def make() -> ShardReader:
        return ShardReader(index, 4, world=World(), epochs=2, block_docs=3, seed=1)

    items = check_restore_at_every_step(make)
    got = [d.data.tolist() for b in items if b.epoch == 0 for d in b]
    assert sorted(got) == sorted(d.tolist() for d in docs if len(d))  # empty ones are skipped
