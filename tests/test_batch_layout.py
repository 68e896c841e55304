"""Batches have one memory layout whatever path made them: ``input_ids`` and ``labels`` are
C-contiguous ``[B, L]`` tensors with 0 workers, with worker processes (the compact
:class:`~torchdata_ext.batch.PackedBatch` rebuilt in the training process), from ``Collate``
directly and through a plain ``StatefulDataLoader``. Training code written nanoGPT-style
(``labels.view(-1)``) runs unchanged when workers are turned on.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchdata_ext import World
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.testing import write_arrow_batches

KEYS = ["input_ids", "labels", "position_ids", "document_ids", "loss_mask"]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("layout")
    rng = np.random.default_rng(4)
    docs = [rng.integers(5, 900, int(rng.integers(1, 60)), dtype=np.uint32) for _ in range(80)]
    write_arrow_batches(str(root / "web" / "a.arrow"), docs)
    return PipelineConfig(
        data_path=str(root), datasets="web", seq_length=24, logical_shards=8, batch_size=3,
        shuffle_buffer=5, block_docs=4, seed=3, epochs=1, output_keys=KEYS,
    )  # fmt: skip


def _build(cfg: PipelineConfig, world: World):
    return build_pipeline(cfg, world)


def check_layout(batch: dict[str, torch.Tensor]) -> None:
    for key in KEYS:
        t = batch[key]
        assert t.shape == (3, 24), key
        assert t.is_contiguous(), f"{key} has strides {t.stride()}"
    # what nanoGPT-style training code does with them
    flat = batch["labels"].view(-1)
    assert flat.tolist() == batch["labels"].reshape(-1).tolist()
    assert (
        batch["input_ids"].view(-1)[1:].tolist()
        == [x for row in batch["input_ids"].tolist() for x in row][1:]
    )
    # labels are the next tokens of input_ids
    assert batch["input_ids"][:, 1:].tolist() == batch["labels"][:, :-1].tolist()


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [0, 2])
def test_token_loader_batches_are_contiguous_with_any_worker_count(cfg, workers) -> None:
    loader = TokenLoader(functools.partial(_build, cfg), num_workers=workers)
    batches = [b for _, b in zip(range(4), loader)]
    assert len(batches) == 4
    for batch in batches:
        check_layout(batch)


def test_collate_paths_are_contiguous(cfg) -> None:
    root = build_pipeline(cfg, World(0, 1, 0, 1))
    root.reset()
    check_layout(next(root))
    check_layout(root.next_packed_batch().to_tensors())


class _Graph(IterableDataset):
    """The graph as a user would hand it to a plain ``StatefulDataLoader``."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        world = World(0, 1, 0 if info is None else info.id, 1 if info is None else info.num_workers)
        root = build_pipeline(self.cfg, world)
        root.reset()
        return iter(root)


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [0, 2])
def test_plain_stateful_dataloader_batches_are_contiguous(cfg, workers) -> None:
    dl = StatefulDataLoader(_Graph(cfg), batch_size=None, num_workers=workers)
    batches = [b for _, b in zip(range(4), dl)]
    assert len(batches) == 4
    for batch in batches:
        check_layout(batch)
