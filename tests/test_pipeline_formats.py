"""Datasets of different formats under one ``data_path``, chosen by suffix (``file_type=None``):
every handler gets the options it needs (``eos_token`` for flat ``.npy``), and the pipeline
delivers exactly what ``prepare`` wrote."""

from __future__ import annotations

import collections
import shutil
from pathlib import Path

import pytest
from harness import check_restore_at_every_step, delivered_documents, run

import torchdata_ext
from torchdata_ext import DatasetIndex, World
from torchdata_ext.handlers import ArrowHandler, CepedHandler, FlatTokenHandler, NpyHandler
from torchdata_ext.handlers.base import handler_accepts
from torchdata_ext.pipeline.build import build_datasets, build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.testing import write_jsonl

WEB = [f"web page {i}: " + "spam " * (i % 5) for i in range(30)]
BOOKS = [f"chapter {i}. " + "It was a dark and stormy night. " * (i % 4) for i in range(12)]


def _ids(text: str) -> tuple[int, ...]:
    """What prepare's byte tokenizer makes of ``text`` (byte ``b`` -> ``b + 1``)."""
    return tuple(b + 1 for b in text.encode())


@pytest.fixture(scope="module")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``web`` prepared as Arrow, ``books`` as flat ``.npy`` (EOS 0 after every document)."""
    root = tmp_path_factory.mktemp("mixed")
    write_jsonl(str(root / "in" / "web.jsonl"), WEB)
    write_jsonl(str(root / "in" / "books.jsonl"), BOOKS)
    data = root / "data"
    torchdata_ext.prepare(str(root / "in" / "web.jsonl"), str(data / "web"), format="arrow",
                          max_tokens_per_file=200, progress=False)  # fmt: skip
    torchdata_ext.prepare(str(root / "in" / "books.jsonl"), str(data / "books"), format="npy",
                          max_tokens_per_file=200, progress=False)  # fmt: skip
    return data


def _config(data_path: Path, **kw) -> PipelineConfig:
    base = dict(
        data_path=str(data_path), datasets="web,books", weights="1,1", file_type=None,
        eos_token=0, bos_token=None, seq_length=64, logical_shards=4, batch_size=2,
        shuffle_buffer=1, epochs=1, block_docs=4, min_length=1,
    )  # fmt: skip
    base.update(kw)
    return PipelineConfig(**base)


def test_arrow_and_flat_npy_prepared_datasets_load_in_one_pipeline(data_path: Path) -> None:
    cfg = _config(data_path)
    datasets = build_datasets(cfg)
    assert {n: ix.file_type for n, ix in datasets.items()} == {"web": "arrow", "books": "npy"}
    # the flat .npy handler got the config's eos_token; the Arrow handler takes none
    assert datasets["books"].handler_options["eos_token"] == 0
    assert "eos_token" not in datasets["web"].handler_options
    assert datasets["books"].total_docs == len(BOOKS) and len(datasets["books"].files) > 1
    got = delivered_documents(build_pipeline(cfg, World(), datasets, collate=False))
    # Arrow documents as prepared; .npy documents end with the EOS prepare wrote after each
    assert got["web"] == collections.Counter(_ids(t) for t in WEB)
    assert got["books"] == collections.Counter((*_ids(t), 0) for t in BOOKS)


def test_mixed_formats_restore_at_every_step(data_path: Path) -> None:
    cfg = _config(data_path, epochs=None, shuffle_buffer=8)
    datasets = build_datasets(cfg)
    check_restore_at_every_step(lambda: build_pipeline(cfg, World(), datasets), max_steps=12)


def test_flat_npy_without_eos_token_asks_for_it(data_path: Path, tmp_path: Path) -> None:
    cfg = _config(data_path, eos_token=None, datasets="books", weights="1")
    with pytest.raises(ValueError, match=r"prepared with eos_token=0.*set eos_token=0"):
        run(build_pipeline(cfg, World(), collate=False))
    # flat tokens with no metadata, no offsets and no eos_token: the file is named
    shutil.copytree(data_path / "books", tmp_path / "books", ignore=shutil.ignore_patterns("meta"))
    with pytest.raises(ValueError, match=r"books/part\d+_\d+\.npy.*no eos_token; pass eos_token"):
        run(build_pipeline(_config(tmp_path, eos_token=None, datasets="books", weights="1"),
                           World(), collate=False))  # fmt: skip


def test_eos_token_reaches_only_the_handlers_that_take_it(data_path: Path) -> None:
    assert handler_accepts(NpyHandler, "eos_token") and handler_accepts(
        FlatTokenHandler, "eos_token"
    )
    assert not handler_accepts(ArrowHandler, "eos_token")
    assert not handler_accepts(CepedHandler, "eos_token")
    web = DatasetIndex.build(str(data_path / "web"), eos_token=0)
    assert web.handler_options == {} and isinstance(web.handler(), ArrowHandler)
    books = DatasetIndex.build(str(data_path / "books"), eos_token=0)
    assert books.handler().eos_token == 0  # type: ignore[attr-defined]
    # an explicit handler option wins over the shared one
    books = DatasetIndex.build(
        str(data_path / "books"), eos_token=0, handler_options={"eos_token": 7}
    )
    assert books.handler().eos_token == 7  # type: ignore[attr-defined]
