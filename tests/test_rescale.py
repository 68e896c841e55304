"""Rescale any to any with the full pipeline: every token of every document exactly once.

An epoch of interleave + pack + shuffle buffer runs at R x W ranks x workers (real
StatefulDataLoader worker processes), is checkpointed mid-epoch to a folder, restored at
R' x W' and finished. In-flight data (interleave remainders, packing remainders, shuffle
buffer contents) must be handed on, so the union of delivered tokens covers every document
exactly once.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from torchdata_ext import World
from torchdata_ext.checkpoint import load_checkpoint, save_checkpoint
from torchdata_ext.loader import TokenLoader
from torchdata_ext.pipeline import PipelineConfig, build_datasets, build_pipeline
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.testing import write_arrow_batches


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("rescale")
    rng = np.random.default_rng(3)
    for name, n_docs, mean in (("web", 160, 20), ("code", 80, 45)):
        docs = [
            rng.integers(5, 30_000, 1 + int(rng.exponential(mean)), dtype=np.uint32)
            for _ in range(n_docs)
        ]
        for f in range(2):
            write_arrow_batches(str(root / name / f"p{f}.arrow"), docs[f::2])
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="2,1", seq_length=32, eos_token=0,
        bos_token=1, logical_shards=24, batch_size=2, seed=5, shuffle_buffer=6, block_docs=5,
        epochs=1, mix_quantum_tokens=0,
    )  # fmt: skip


def build(cfg: PipelineConfig, world: World):
    return build_pipeline(cfg, world, collate=False)


def expected_lengths(cfg: PipelineConfig) -> dict[tuple[str, int, int], int]:
    out = {}
    for name, index in build_datasets(cfg).items():
        handler = index.handler()
        for f, url in enumerate(index.files):
            reader = handler.open(url)
            for d, n in enumerate(handler.doc_lengths(reader).tolist()):
                out[(name, f, d)] = n
    return out


def cover(coverage: dict, seqs, names) -> None:
    for seq in seqs:
        prov = np.asarray(seq["provenance"])
        for ds, f, d, start, length in prov.tolist():
            if ds in (LITERAL, PAD):
                continue
            key = (names[ds], f, d)
            coverage.setdefault(key, []).append((start, start + length))


def check_exactly_once(coverage: dict, lengths: dict) -> None:
    assert set(coverage) == set(lengths), "documents missing or unknown"
    for key, ranges in coverage.items():
        ranges.sort()
        pos = 0
        for a, b in ranges:
            assert a == pos, f"{key}: tokens {pos}..{a} missing or repeated (ranges {ranges})"
            pos = b
        assert pos == lengths[key], f"{key}: covered {pos} of {lengths[key]} tokens"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("old", [(2, 2), (3, 1)], ids=str)
@pytest.mark.parametrize("new", [(1, 0), (1, 1), (1, 3), (2, 2), (3, 1), (4, 2)], ids=str)
def test_full_pipeline_rescale_exactly_once(cfg, tmp_path, old, new) -> None:
    lengths = expected_lengths(cfg)
    coverage: dict = {}
    ckpt = str(tmp_path / "ckpt")
    R, W = old
    for r in range(R):
        loader = TokenLoader(functools.partial(build, cfg), num_workers=W, rank=r, world_size=R)
        seqs = []
        for seq in loader:
            seqs.append(seq)
            if len(seqs) >= 7 + 2 * r:
                break
        cover_with_names(coverage, seqs, loader)
        save_checkpoint(loader, ckpt)
    R2, W2 = new
    for r in range(R2):
        loader = TokenLoader(functools.partial(build, cfg), num_workers=W2, rank=r, world_size=R2)
        load_checkpoint(loader, ckpt)
        cover_with_names(coverage, list(loader), loader)
    check_exactly_once(coverage, lengths)


def cover_with_names(coverage, seqs, loader) -> None:
    """Provenance dataset ids index the datasets in config order (the pipeline pins them)."""
    del loader
    cover(coverage, seqs, NAMES)


NAMES = ["web", "code"]


def _phase1(cfg, ckpt, steps=6):
    coverage: dict = {}
    loader = TokenLoader(functools.partial(build, cfg))
    seqs = []
    for seq in loader:
        seqs.append(seq)
        if len(seqs) >= steps:
            break
    cover(coverage, seqs, NAMES)
    save_checkpoint(loader, ckpt)
    return coverage


def test_changed_weights_are_refused_unless_accepted(cfg, tmp_path) -> None:
    import dataclasses

    ckpt = str(tmp_path / "ckpt")
    coverage = _phase1(cfg, ckpt)
    reweighted = dataclasses.replace(cfg, weights=[1.0, 1.0])
    with pytest.raises(ValueError, match="weight differs .*allow_weight_changes=True"):
        load_checkpoint(TokenLoader(functools.partial(build, reweighted)), ckpt)
    loader = TokenLoader(functools.partial(build, reweighted))
    load_checkpoint(loader, ckpt, allow_weight_changes=True)
    cover(coverage, list(loader), NAMES)
    check_exactly_once(coverage, expected_lengths(cfg))


def test_added_dataset_is_refused_unless_accepted(cfg, tmp_path) -> None:
    import dataclasses

    only_web = dataclasses.replace(cfg, datasets=["web"], weights=[1.0])
    ckpt = str(tmp_path / "ckpt")
    coverage = _phase1(only_web, ckpt, steps=10)
    with pytest.raises(ValueError, match="'code' is in this pipeline but not in the checkpoint"):
        load_checkpoint(TokenLoader(functools.partial(build, cfg)), ckpt)
    loader = TokenLoader(functools.partial(build, cfg))
    with pytest.raises(ValueError, match="'web': weight differs"):  # 1.0 alone, now 2 of 3
        load_checkpoint(loader, ckpt, allow_new_datasets=True)
    load_checkpoint(loader, ckpt, allow_new_datasets=True, allow_weight_changes=True)
    from torchdata_ext.checkpoint import _token_counters

    (counters,) = [
        c for st in loader.state_dict()["workers"].values() for c in _token_counters(st).values()
    ]
    # web's count carries on; code starts at its target share (1 of 3) of the tokens so far
    assert counters["web"] >= 10 * cfg.seq_length
    assert counters["code"] == counters["web"] // 2
    seqs = list(loader)
    cover(coverage, seqs, NAMES)
    check_exactly_once(coverage, expected_lengths(cfg))  # web finished once, code read once
