"""Logical-shard maths: disjoint, complete, balanced, local."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_ext.shards import (
    check_shard_count,
    file_offsets,
    shard_bounds,
    shard_fragments,
    worker_shards,
)

counts_st = st.lists(st.integers(0, 400), min_size=1, max_size=25).filter(lambda c: sum(c) > 0)


@settings(max_examples=300, deadline=None)
@given(counts=counts_st, data=st.data())
def test_shards_are_disjoint_and_cover_every_document(counts: list[int], data) -> None:
    total = sum(counts)
    n = data.draw(st.integers(1, total))
    offsets = file_offsets(counts)
    seen = np.zeros(total, np.int64)
    sizes = []
    for s in range(n):
        frags = shard_fragments(offsets, n, s)
        size = 0
        for f in frags:
            assert 0 <= f.start < f.stop <= counts[f.file]
            seen[offsets[f.file] + f.start : offsets[f.file] + f.stop] += 1
            size += f.size
        # fragments come in file order and are contiguous in the global numbering
        glob = [(offsets[f.file] + f.start, offsets[f.file] + f.stop) for f in frags]
        assert all(a[1] == b[0] for a, b in zip(glob, glob[1:]))
        sizes.append(size)
        # a contiguous range touches only the files it overlaps: no more than needed
        assert len(frags) <= len({f.file for f in frags})
    assert (seen == 1).all()
    assert max(sizes) - min(sizes) <= 1
    assert np.array_equal(np.diff(shard_bounds(total, n)), sizes)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 5000), data=st.data())
def test_workers_own_disjoint_balanced_shard_sets(n: int, data) -> None:
    g = data.draw(st.integers(1, n))
    owned = [worker_shards(n, g, w) for w in range(g)]
    flat = [s for r in owned for s in r]
    assert flat == list(range(n))
    lens = [len(r) for r in owned]
    assert max(lens) - min(lens) <= 1 and min(lens) >= 1


@settings(max_examples=100, deadline=None)
@given(
    counts=counts_st,
    ranks=st.integers(1, 6),
    workers=st.integers(1, 4),
    data=st.data(),
)
def test_every_document_has_exactly_one_global_worker(counts, ranks, workers, data) -> None:
    total = sum(counts)
    g = ranks * workers
    if g > total:
        return
    n = data.draw(st.integers(g, total))
    offsets = file_offsets(counts)
    owner = np.full(total, -1)
    for w in range(g):
        for s in worker_shards(n, g, w):
            for f in shard_fragments(offsets, n, s):
                sl = slice(offsets[f.file] + f.start, offsets[f.file] + f.stop)
                assert (owner[sl] == -1).all()
                owner[sl] = w
    assert (owner >= 0).all()


def test_bad_shard_counts_name_the_argument_and_fix() -> None:
    with pytest.raises(ValueError, match="n_logical_shards=3 must be >= .*global workers.*raise"):
        check_shard_count(3, 100, 4)
    with pytest.raises(ValueError, match="n_logical_shards=101 must be <= .*documents"):
        check_shard_count(101, 100, 1)
    with pytest.raises(TypeError, match="n_logical_shards=2.5 must be an integer"):
        check_shard_count(2.5, 100, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_logical_shards=0"):
        shard_bounds(10, 0)
    with pytest.raises(ValueError, match="shard=4 must be <"):
        shard_fragments(file_offsets([10]), 4, 4)
    with pytest.raises(ValueError, match="non-negative"):
        file_offsets([3, -1])
    with pytest.raises(ValueError, match="global_worker=3 must be < total_workers=3"):
        worker_shards(10, 3, 3)


def test_huge_counts_do_not_overflow() -> None:
    total = 3 * 10**15
    b = shard_bounds(total, 30720)
    assert b[-1] == total and (np.diff(b) >= total // 30720).all()
