"""No rank reads a data file rewritten under a checkpoint: without a process group each rank
checks the files its shards read (whoever's share of the checks they are), and an index
listed before the restore (built earlier in the process, or read from an index file) is
asked again, as a fresh process would list it."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_ext import PipelineConfig, TokenLoader, build_pipeline
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.order.shards import shard_fragments, shards_files
from torchdata_ext.pipeline.build import build_datasets
from torchdata_ext.sources import fingerprint
from torchdata_ext.sources.fingerprint import ChangedFilesError
from torchdata_ext.testing import write_arrow_batches

SIZES = (30, 10, 20, 12)  # documents per file: shards cut files fractionally


def _docs(seed: int, f: int) -> list[np.ndarray]:
    """File ``f``'s documents; another ``seed`` gives the same lengths (the same file size)."""
    rng = np.random.default_rng(seed * 100 + f)
    lengths = np.random.default_rng(f).integers(3, 20, SIZES[f])
    return [rng.integers(5, 9000, n).astype(np.uint32) for n in lengths]


def _corpus(root: Path) -> None:
    for f in range(len(SIZES)):
        write_arrow_batches(str(root / "web" / f"p{f}.arrow"), _docs(1, f))


def _cfg(root: Path) -> PipelineConfig:
    return PipelineConfig(
        data_path=str(root), datasets="web", seq_length=16, batch_size=2, logical_shards=12,
        shuffle_buffer=3, block_docs=4, seed=1, eos_token=0,
    )  # fmt: skip


def _save(root: Path, ckpt: Path, ranks: int) -> None:
    for r in range(ranks):
        loader = TokenLoader(
            functools.partial(build_pipeline, _cfg(root)), rank=r, world_size=ranks
        )
        it = iter(loader)
        for _ in range(2):
            next(it)
        save_checkpoint(loader, str(ckpt))
        loader.close()


def _read_by(root: Path, rank: int, ranks: int, n_old: int) -> set[int]:
    """The files rank ``rank`` of ``ranks`` (1 worker each) reads after a restore from
    ``n_old`` ranks: its 12 / ranks shards' and those of the old ranks it takes over from."""
    n, counts = 12, np.asarray(SIZES)
    mine = range(rank * n // ranks, (rank + 1) * n // ranks)
    old = [g for g in range(n_old) if range(g * n // n_old, (g + 1) * n // n_old)[0] < mine.stop
           and (g + 1) * n // n_old > mine.start]  # fmt: skip
    shards = range(min(mine.start, old[0] * n // n_old), max(mine.stop, (old[-1] + 1) * n // n_old))
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return {f.file for s in shards for f in shard_fragments(offsets, n, s)}


@pytest.mark.parametrize(("saved", "restored"), [(2, 2), (2, 3), (3, 2)])
def test_each_rank_without_a_process_group_refuses_every_changed_file_it_reads(
    tmp_path: Path, saved: int, restored: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every (file rewritten in place, rank) pair: a rank whose shards read the file refuses
    it, naming it; a rank that does not read it may restore (its share of the checks aside)."""
    for changed in range(len(SIZES)):
        root = tmp_path / f"f{changed}"
        _corpus(root)
        _save(root, root / "ckpt", saved)
        write_arrow_batches(str(root / "web" / f"p{changed}.arrow"), _docs(2, changed))
        for r in range(restored):
            monkeypatch.setattr(fingerprint, "_digests", {})  # each rank a process of its own
            loader = TokenLoader(
                functools.partial(build_pipeline, _cfg(root)), rank=r, world_size=restored
            )
            try:
                load_checkpoint(loader, str(root / "ckpt"))
                refused = ""
            except ChangedFilesError as e:
                refused = str(e)
            reads = _read_by(root, r, restored, saved)
            share = set(range(r, len(SIZES), restored))
            if changed in reads | share:
                assert f"p{changed}.arrow" in refused, (changed, r, reads)
            else:
                assert refused == "", (changed, r, reads, refused)


def test_indexes_built_before_a_rewrite_are_asked_again_at_a_restore(tmp_path: Path) -> None:
    """``build_pipeline(cfg, datasets=build_datasets(cfg))``, the datasets built once in the
    process: a file rewritten after they were listed is refused at a restore, on every rank."""
    _corpus(tmp_path)
    datasets = build_datasets(_cfg(tmp_path))
    build = functools.partial(build_pipeline, _cfg(tmp_path), datasets=datasets)
    loader = TokenLoader(build)
    it = iter(loader)
    next(it)
    save_checkpoint(loader, str(tmp_path / "ckpt"))
    rest = [next(it)["input_ids"].tolist() for _ in range(3)]
    again = TokenLoader(build)  # unchanged: restores exactly
    load_checkpoint(again, str(tmp_path / "ckpt"))
    assert [b["input_ids"].tolist() for b, _ in zip(again, range(3))] == rest
    write_arrow_batches(str(tmp_path / "web" / "p3.arrow"), _docs(2, 3))
    for rank, ranks in ((0, 1), (0, 2), (1, 2)):
        with pytest.raises(ChangedFilesError, match=r"dataset 'web': 1 file\(s\): p3\.arrow \("):
            load_checkpoint(TokenLoader(build, rank=rank, world_size=ranks), str(tmp_path / "ckpt"))


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 30), min_size=1, max_size=8).filter(lambda c: sum(c) > 0),
    n=st.integers(1, 40),
    data=st.data(),
)
def test_shards_files_are_the_files_of_their_fragments(counts: list[int], n: int, data) -> None:
    first = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(first, n))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    expected = sorted({f.file for s in range(first, stop) for f in shard_fragments(offsets, n, s)})
    assert shards_files(counts, n, range(first, stop)) == expected
