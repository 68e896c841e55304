"""A state meets its config by dataset name, never by place: a run restored under a config that
lists the same datasets (same weight per name) in another order goes on exactly once, and the
provenance ids of every row it delivers index the datasets in the order of the config it runs
with (what a trainer holding that config reads them by).

Each row is checked against the files: its ``input_ids`` are the tokens its provenance names,
read again by a fresh pipeline of that config, and the union of the rows over the save and the
restore covers every document's tokens exactly once.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from harness import check_exactly_once, document_lengths, write_random_arrow_datasets

from torchdata_ext import PipelineConfig, TokenLoader, World, build_pipeline
from torchdata_ext.checkpoint.dcp import DCPLoaderState
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.provenance import remap_ids
from torchdata_ext.state.graph import graph_nodes


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("order")
    write_random_arrow_datasets(str(root), (("web", 160, 20), ("code", 80, 45)), seed=3)
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="2,1", seq_length=32, eos_token=0,
        bos_token=1, logical_shards=24, batch_size=2, seed=5, shuffle_buffer=6, block_docs=5,
        epochs=1, mix_quantum_tokens=0, output_keys="input_ids,provenance",
    )  # fmt: skip


def reordered(cfg: PipelineConfig, mode: str = "tokens") -> PipelineConfig:
    """``cfg`` with its datasets listed the other way round, each keeping its weight."""
    return dataclasses.replace(cfg, datasets="code,web", weights="1,2", interleave_mode=mode)


class Trainer:
    """What a trainer receives, checked row by row against the files: each row's tokens are
    those its provenance names (ids in the order of the config it runs with)."""

    def __init__(self) -> None:
        self.coverage: dict = {}
        self.rows = 0

    def take(self, cfg: PipelineConfig, batches) -> None:
        root = build_pipeline(cfg, World(0, 1, 0, 1), collate=False)
        pack = next(n for n in graph_nodes(root) if isinstance(n, Pack))
        pack.reset(None)
        names = [str(n) for n in cfg.datasets]
        assert pack.dataset_names == names
        for batch in batches:
            ids = np.asarray(batch["input_ids"])
            for row, prov in zip(ids, np.asarray(batch["provenance"])):
                prov = prov[prov[:, 4] > 0]
                np.testing.assert_array_equal(row, pack.rebuild(prov)["input_ids"])
                self.rows += 1
                for ds, f, d, start, length in prov[prov[:, 0] >= 0].tolist():
                    self.coverage.setdefault((names[ds], f, d), []).append((start, start + length))


def first_part(cfg: PipelineConfig, ckpt: str, trainer: Trainer, ranks: int, workers: int, n=12):
    for r in range(ranks):
        loader = TokenLoader(
            functools.partial(build_pipeline, cfg), num_workers=workers, rank=r, world_size=ranks
        )
        batches = []
        for batch in loader:
            batches.append(batch)
            if len(batches) == n + 3 * r:
                break
        trainer.take(cfg, batches)
        save_checkpoint(loader, ckpt)


def restored(cfg: PipelineConfig, ckpt: str, ranks: int, workers: int) -> list[TokenLoader]:
    out = []
    for r in range(ranks):
        loader = TokenLoader(
            functools.partial(build_pipeline, cfg), num_workers=workers, rank=r, world_size=ranks
        )
        load_checkpoint(loader, ckpt)
        out.append(loader)
    return out


@pytest.mark.parametrize(
    ("workers", "mode"),
    [(0, "tokens"), (0, "samples"), pytest.param(2, "samples", marks=pytest.mark.multiprocess)],
    ids=str,
)
def test_restore_with_the_datasets_listed_the_other_way(cfg, tmp_path, workers, mode) -> None:
    """Same topology. Before the fix the provenance ids kept the checkpoint's order (every
    restored row named the other dataset) and in ``samples`` mode the mix mapped its draws to
    the sources in the new order, so the block replayed on restore was another one: tokens
    delivered twice and lost."""
    cfg = dataclasses.replace(cfg, interleave_mode=mode)
    ckpt, trainer = str(tmp_path / "c"), Trainer()
    first_part(cfg, ckpt, trainer, 1, workers)
    other = reordered(cfg, mode)
    (loader,) = restored(other, ckpt, 1, workers)
    trainer.take(other, loader)
    check_exactly_once(trainer.coverage, document_lengths(cfg))


def test_rescaled_and_restored_in_either_order(cfg, tmp_path) -> None:
    """2 ranks -> 3 ranks under the other order, a few batches, a save, then the same 3 ranks
    under the first order again: exactly once over the three parts."""
    trainer = Trainer()
    first_part(cfg, str(tmp_path / "a"), trainer, 2, 0)
    other = reordered(cfg)
    for loader in restored(other, str(tmp_path / "a"), 3, 0):
        batches = []
        for batch in loader:
            batches.append(batch)
            if len(batches) == 5:
                break
        trainer.take(other, batches)
        save_checkpoint(loader, str(tmp_path / "b"))
    for loader in restored(cfg, str(tmp_path / "b"), 3, 0):
        trainer.take(cfg, loader)
    check_exactly_once(trainer.coverage, document_lengths(cfg))


def test_dcp_restore_with_the_datasets_listed_the_other_way(cfg, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    trainer = Trainer()
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == 12:
            break
    trainer.take(cfg, batches)
    dcp.save({"data": DCPLoaderState(loader)}, checkpoint_id=str(tmp_path / "dcp"))
    other = reordered(cfg)
    fresh = TokenLoader(functools.partial(build_pipeline, other))
    dcp.load({"data": DCPLoaderState(fresh)}, checkpoint_id=str(tmp_path / "dcp"))
    trainer.take(other, fresh)
    check_exactly_once(trainer.coverage, document_lengths(cfg))


def test_a_reader_refuses_the_state_of_another_dataset() -> None:
    """Phases are matched by place: swapped, a dataset's reader is handed the state of another.
    Two datasets whose files have the same names and document counts pass the fingerprint
    check, so before the name check the reader took the other dataset's cursors silently."""
    from torchdata_ext import DatasetIndex
    from torchdata_ext.nodes.concat import Concat
    from torchdata_ext.nodes.reader import ShardReader

    docs = [np.arange(1 + i % 7) for i in range(40)]
    index = {n: DatasetIndex.from_documents(n, docs, docs_per_file=10) for n in ("web", "code")}
    assert index["web"].fingerprint() == index["code"].fingerprint()

    def curriculum(order):
        return Concat([ShardReader(index[n], 4, world=World(0, 1, 0, 1), epochs=1) for n in order])

    root = curriculum(["web", "code"])
    root.reset(None)
    next(root)
    with pytest.raises(ValueError, match="dataset 'code' from the reader state of dataset 'web'"):
        curriculum(["code", "web"]).reset(root.state_dict())


def test_remap_ids() -> None:
    rows = np.array([[0, 3, 4, 0, 5], [-1, 7, 0, 0, 1], [1, 2, 9, 5, 6], [-2, 0, 0, 0, 3]])
    assert remap_ids(rows, ["web", "code"], ["web", "code", "x"]) is rows
    np.testing.assert_array_equal(
        remap_ids(rows, ["web", "code"], ["code", "web"])[:, 0], [1, -1, 0, -2]
    )
    with pytest.raises(ValueError, match=r"datasets \['code'\], which this pipeline"):
        remap_ids(rows, ["web", "code"], ["web"])


@pytest.mark.parametrize("ranks", [1, 2], ids=["same_topology", "rescaled"])
def test_curriculum_phases_in_another_order_are_refused_naming_them(cfg, tmp_path, ranks) -> None:
    """Phases are places in a curriculum (each holds its own budget): a checkpoint restored with
    its phases swapped is refused, naming each phase's datasets, also on a rescale (before,
    the rescale restored each reader by name but gave phase 0's remaining budget to the
    dataset now in phase 0)."""
    phases = [{"datasets": "web", "max_tokens": 900}, {"datasets": "code"}]
    run = dataclasses.replace(cfg, datasets=[], weights=[], phases=phases)
    first_part(run, str(tmp_path / "c"), Trainer(), 1, 0, n=4)
    swapped = dataclasses.replace(run, phases=phases[::-1])
    with pytest.raises(
        ValueError,
        match=r"phases read other datasets \(phase 0: checkpoint \['web'\], now \['code'\]; "
        r"phase 1: checkpoint \['code'\], now \['web'\]\); list the phases in the checkpoint's",
    ):
        restored(swapped, str(tmp_path / "c"), ranks, 0)
    restored(run, str(tmp_path / "c"), 1, 0)  # the same phases restore
