"""The evaluation loader: exactly the held-out documents over all ranks and workers, fixed-shape
padded batches, equal batch counts across real gloo ranks, a cache that reads no file again,
and the split recorded in (and enforced by) checkpoints."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil

import numpy as np
import pytest
import torch
from _gloo import rank_context
from harness import check_exactly_once

from torchdata_ext import PipelineConfig, World, build_datasets, build_pipeline
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.evaluation import ROW_MASK, EvalLoader
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.order.split import heldout_documents
from torchdata_ext.pipeline.build import build_eval_pipeline
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.sources.file_access import FileAccess
from torchdata_ext.testing import write_arrow_batches

NAMES = ["web", "code"]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("evaluation")
    rng = np.random.default_rng(11)
    for name, n_docs in (("web", 240), ("code", 120)):
        docs = [
            rng.integers(5, 30_000, int(rng.integers(1, 40)), dtype=np.uint32)
            for _ in range(n_docs)
        ]
        for f in range(3):
            write_arrow_batches(str(root / name / f"p{f}.arrow"), docs[f::3])
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="2,1", seq_length=16, eos_token=0,
        logical_shards=12, batch_size=3, seed=5, shuffle_buffer=8, block_docs=5,
        mix_quantum_tokens=0, eval_fraction=0.15, eval_seed=9,
        output_keys="input_ids,labels,position_ids,provenance",
    )  # fmt: skip


def lengths(cfg: PipelineConfig, which: str) -> dict[tuple[str, int, int], int]:
    """Tokens per document: ``which`` is "eval" (held out), "train" (the rest) or "all"."""
    out = {}
    for name, index in build_datasets(cfg).items():
        held = set(heldout_documents(index, cfg.eval_split(name)))
        handler = index.handler()
        for f, url in enumerate(index.files):
            reader = handler.open(url)
            for d, n in enumerate(handler.doc_lengths(reader).tolist()):
                if which == "all" or ((f, d) in held) == (which == "eval"):
                    out[(name, f, d)] = n
    return out


def cover(coverage: dict, provenance: np.ndarray) -> None:
    for ds, f, d, start, n in provenance.reshape(-1, 5).tolist():
        if ds not in (LITERAL, PAD) and n:
            coverage.setdefault((NAMES[ds], f, d), []).append((start, start + n))


def eval_coverage(cfg, ranks: int, workers: int, **kw) -> tuple[dict, list[int]]:
    coverage: dict = {}
    counts = []
    for r in range(ranks):
        batches = list(EvalLoader(cfg, rank=r, world_size=ranks, num_workers=workers, **kw))
        counts.append(len(batches))
        for b in batches:
            check_batch(cfg, b)
            cover(coverage, b["provenance"][b[ROW_MASK]].numpy())
    return coverage, counts


def check_batch(cfg: PipelineConfig, b: dict) -> None:
    """Every batch has the full shape; padding rows carry no token of any document."""
    B, L = cfg.batch_size, cfg.seq_length
    for key in ("input_ids", "labels", "position_ids", "loss_mask"):
        assert tuple(b[key].shape) == (B, L), key
    assert b[ROW_MASK].dtype == torch.bool and tuple(b[ROW_MASK].shape) == (B,)
    pad_rows = ~b[ROW_MASK]
    assert not b["loss_mask"][pad_rows].any()
    assert (b["input_ids"][pad_rows] == cfg.pad_token).all()
    assert (b["provenance"][pad_rows][..., 4] == 0).all()


@pytest.mark.multiprocess
@pytest.mark.parametrize(("ranks", "workers"), [(1, 0), (2, 0), (3, 0), (2, 2)], ids=str)
def test_union_over_ranks_is_exactly_the_heldout_set(cfg, ranks, workers) -> None:
    coverage, counts = eval_coverage(cfg, ranks, workers)
    expected = lengths(cfg, "eval")
    assert 30 < len(expected) < 90
    check_exactly_once(coverage, expected)  # every held-out token once, nothing else


def test_train_and_eval_together_cover_every_document_once(cfg) -> None:
    coverage, _ = eval_coverage(cfg, 2, 0)
    train = dataclasses.replace(cfg, epochs=1)
    for r in range(2):
        loader = TokenLoader(functools.partial(build_pipeline, train), rank=r, world_size=2)
        for b in loader:
            cover(coverage, b["provenance"].numpy())
    check_exactly_once(coverage, lengths(cfg, "all"))


def test_no_shuffle_buffer_and_one_epoch(cfg) -> None:
    endless = dataclasses.replace(cfg, epochs=None)
    root = build_eval_pipeline(endless, World(0, 1, 0, 1))
    from torchdata_ext.nodes import ShardReader, ShuffleBuffer
    from torchdata_ext.state.graph import graph_nodes

    nodes = list(graph_nodes(root))
    assert not any(isinstance(n, ShuffleBuffer) for n in nodes)
    readers = [n for n in nodes if isinstance(n, ShardReader)]
    assert len(readers) == 2 and all(r.epochs == 1 for r in readers)
    # endless training config: the eval stream still ends after every held-out document
    coverage, _ = eval_coverage(endless, 1, 0)
    check_exactly_once(coverage, lengths(cfg, "eval"))


def test_cache_second_pass_reads_no_file(cfg, tmp_path, monkeypatch) -> None:
    data = tmp_path / "data"
    shutil.copytree(cfg.data_path, data)
    moved = dataclasses.replace(cfg, data_path=str(data))
    cached = EvalLoader(moved, cache=True)
    uncached = EvalLoader(moved)
    first = list(cached)
    assert len(first) > 5
    opened = []
    real_open = FileAccess.open
    monkeypatch.setattr(
        FileAccess, "open", lambda self, f, up: opened.append(f) or real_open(self, f, up)
    )
    shutil.rmtree(data)  # nothing left to read
    second = list(cached)
    assert not opened
    assert len(second) == len(first)
    for a, b in zip(first, second):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(Exception, match="p[0-9].arrow"):  # without the cache: read again
        list(uncached)
    cached.clear_cache()
    with pytest.raises(Exception, match="p[0-9].arrow"):
        list(cached)


def _gloo_rank(rank: int, world: int, init: str, cfg: PipelineConfig, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        made = []  # batches the loader had finished when each one was delivered
        evaluation = EvalLoader(cfg)
        padded = evaluation._padded
        evaluation._padded = lambda b: (made.append(None), padded(b))[1]  # type: ignore[method-assign]
        batches, finished = [], []
        for b in evaluation:
            batches.append(b)
            finished.append(len(made))
        prov = [b["provenance"][b[ROW_MASK]].numpy() for b in batches]
        rows = [int(b[ROW_MASK].sum()) for b in batches]
        with open(out, "w") as f:
            json.dump(
                {
                    "batches": len(batches),
                    "rows": rows,
                    "prov": [p.tolist() for p in prov],
                    "finished": finished,
                },
                f,
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_equal_batch_counts_across_gloo_ranks(cfg, tmp_path) -> None:
    small = dataclasses.replace(cfg, batch_size=2)
    _, unequal = eval_coverage(small, 2, 0, equal_batches=False)
    assert unequal[0] != unequal[1]  # without equalizing, the ranks differ
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    init = f"file://{tmp_path / 'store'}"
    ctx = rank_context()
    procs = [ctx.Process(target=_gloo_rank, args=(r, 2, init, small, outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    results = []
    for o in outs:
        with open(o) as f:
            results.append(json.load(f))
    assert [r["batches"] for r in results] == [max(unequal)] * 2
    for res in results:  # delivered as made: no rank holds its batches back to count them
        assert res["finished"] == list(range(1, max(unequal) + 1))
    coverage: dict = {}
    for r, res in enumerate(results):
        assert res["rows"][unequal[r] :] == [0] * (max(unequal) - unequal[r])  # padding batches
        for p in res["prov"]:
            cover(coverage, np.asarray(p, np.int64))
    check_exactly_once(coverage, lengths(cfg, "eval"))


def test_checkpoint_records_and_enforces_the_split(cfg, tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    loader = TokenLoader(functools.partial(build_pipeline, cfg))
    for i, _ in enumerate(loader):
        if i == 3:
            break
    save_checkpoint(loader, ckpt)
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["datasets"]["web"]["split"] == {
        "eval_fraction": 0.15,
        "seed": 9,
        "subset": "train",
    }
    for changed in ({"eval_fraction": 0.2}, {"eval_seed": 1}, {"eval_fraction": 0.0}):
        other = TokenLoader(functools.partial(build_pipeline, dataclasses.replace(cfg, **changed)))
        with pytest.raises(ValueError, match="held-out split differ"):
            load_checkpoint(other, ckpt)
    same = TokenLoader(functools.partial(build_pipeline, cfg))
    load_checkpoint(same, ckpt)


def test_config_errors_name_the_field(cfg) -> None:
    with pytest.raises(ValueError, match="holds out no documents"):
        EvalLoader(dataclasses.replace(cfg, eval_fraction=0.0))
    with pytest.raises(ValueError, match="eval_fraction=1.5"):
        dataclasses.replace(cfg, eval_fraction=1.5)
    with pytest.raises(ValueError, match=r"eval_fraction names datasets \['wbe'\]"):
        dataclasses.replace(cfg, eval_fraction={"wbe": 0.1})
    with pytest.raises(ValueError, match="equal_batches=True needs torch.distributed"):
        list(EvalLoader(cfg, equal_batches=True))
    only_code = dataclasses.replace(cfg, eval_fraction={"code": 0.2})
    root = build_eval_pipeline(only_code, World(0, 1, 0, 1))
    from torchdata_ext.state.graph import reader_states

    root.reset()
    assert [st["dataset"] for st in reader_states(root.state_dict()).values()] == ["code"]


def test_whole_batch_boundary_keys_are_refused(tmp_path):
    """cu_seqlens and max_seqlen describe a whole batch: an EvalLoader's padding rows would
    make them wrong, so they are refused by name (seq_lens, per row, is padded)."""
    import dataclasses

    import pytest

    from torchdata_ext import EvalLoader, PipelineConfig

    cfg = PipelineConfig(data_path=str(tmp_path), datasets=["x"], seq_length=8, batch_size=2)
    for key in ("cu_seqlens", "max_seqlen"):
        bad = dataclasses.replace(cfg, output_keys=("input_ids", key))
        with pytest.raises(ValueError, match=f"output_keys \\['{key}'\\].*use 'seq_lens'"):
            EvalLoader(bad)


@pytest.mark.parametrize("batch_size", [7, 4])
def test_a_padding_rows_seq_lens_is_one_segment_of_the_row(cfg, batch_size) -> None:
    """Issue 44 item 4: padding rows had all-zero seq_lens (sum 0, not the row's length)."""
    import dataclasses

    from torchdata_ext import EvalLoader
    from torchdata_ext.loader.evaluation import ROW_MASK

    keys = "input_ids,labels,position_ids,seq_lens"
    ev = dataclasses.replace(cfg, output_keys=keys, batch_size=batch_size)
    batches = list(EvalLoader(ev))
    padded = 0
    for b in batches:
        assert (b["seq_lens"].sum(dim=1) == cfg.seq_length).all()
        for row, real in zip(b["seq_lens"].tolist(), b[ROW_MASK].tolist(), strict=True):
            if not real:
                padded += 1
                assert row == [cfg.seq_length] + [0] * (len(row) - 1)
    assert padded > 0
