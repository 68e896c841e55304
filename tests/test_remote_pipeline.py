"""The full pipeline over s3:// (a moto server on 127.0.0.1): same data as local disk, and a
checkpoint written to an s3:// folder restores on another topology, exactly once."""

from __future__ import annotations

import functools

import pytest
from harness import check_exactly_once, document_lengths, item_key, run, write_random_arrow_datasets
from test_rescale import NAMES, cover

from torchdata_ext import World
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig


def _write_corpus(root: str, storage_options=None) -> None:
    write_random_arrow_datasets(
        root, (("web", 90, 20), ("code", 50, 40)), seed=11, storage_options=storage_options
    )


def _cfg(root: str, storage_options=None) -> PipelineConfig:
    return PipelineConfig(
        data_path=root, datasets="web,code", weights="2,1", seq_length=32, eos_token=0, bos_token=1,
        logical_shards=12, batch_size=2, seed=3, shuffle_buffer=5, block_docs=4, epochs=1,
        storage_options=dict(storage_options or {}),
    )  # fmt: skip


def build(cfg: PipelineConfig, world: World):
    return build_pipeline(cfg, world, collate=False)


@pytest.mark.multiprocess
def test_full_pipeline_over_s3_equals_local_and_rescales_from_s3_checkpoint(s3, tmp_path) -> None:
    local = str(tmp_path / "data")
    _write_corpus(local)
    _write_corpus(s3.url("data"), s3.storage_options)
    cfg_local, cfg_s3 = _cfg(local), _cfg(s3.url("data"), s3.storage_options)
    for workers in (1, 2):
        for w in range(workers):
            a = [item_key(x) for x in run(build(cfg_local, World(0, 1, w, workers)))]
            b = [item_key(x) for x in run(build(cfg_s3, World(0, 1, w, workers)))]
            assert a == b and len(a) > 10
    # checkpoint mid-epoch at 2 ranks x 1 worker into s3://, restore at 1 rank x 2 workers
    lengths = document_lengths(cfg_local)
    coverage: dict = {}
    ckpt = s3.url("ckpt", "step_7")
    for r in range(2):
        loader = TokenLoader(functools.partial(build, cfg_s3), num_workers=1, rank=r, world_size=2)
        seqs = []
        for seq in loader:
            seqs.append(seq)
            if len(seqs) >= 7:
                break
        cover(coverage, seqs, NAMES)
        save_checkpoint(loader, ckpt, storage_options=s3.storage_options)
    loader = TokenLoader(functools.partial(build, cfg_s3), num_workers=2)
    load_checkpoint(loader, ckpt, storage_options=s3.storage_options)
    cover(coverage, list(loader), NAMES)
    check_exactly_once(coverage, lengths)


@pytest.mark.multiprocess
def test_loader_reports_io_counters_from_worker_processes(s3) -> None:
    _write_corpus(s3.url("d2"), s3.storage_options)
    cfg = _cfg(s3.url("d2"), s3.storage_options)
    loader = TokenLoader(functools.partial(build, cfg), num_workers=2)
    n = sum(1 for _ in loader)
    stats = loader.io_stats()
    assert n > 0 and stats["files_opened"] >= 4
    assert stats["bytes_downloaded"] > 0 and stats["wait_seconds"] >= 0
