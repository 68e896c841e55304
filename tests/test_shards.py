"""Logical-shard maths: disjoint, complete, balanced, local."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_ext.order.shards import (
    check_shard_count,
    count_new_readers,
    file_offsets,
    old_workers_to_read,
    shard_bounds,
    shard_fragments,
    shard_owner,
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


# -- rescaling: the inverse maps, against brute-force loops over every worker ---------------------
def _overlap(n: int, total: int, worker: int, other_total: int) -> list[int]:
    mine = worker_shards(n, total, worker)
    return [
        g
        for g in range(other_total)
        if (theirs := worker_shards(n, other_total, g)).start < mine.stop
        and mine.start < theirs.stop
    ]


@st.composite
def rescales(draw, max_shards: int = 3000) -> tuple[int, int, int]:
    n = draw(st.integers(1, max_shards))
    old_total = draw(st.integers(1, n))
    new_total = draw(st.one_of(st.integers(1, n), st.sampled_from([old_total, n, 1])))
    return n, old_total, new_total


@settings(max_examples=250, deadline=None)
@given(n=st.integers(1, 5000), data=st.data())
def test_shard_owner_is_the_worker_whose_shards_hold_it(n: int, data) -> None:
    total = data.draw(st.integers(1, n))
    s = data.draw(st.integers(0, n - 1))
    g = shard_owner(n, total, s)
    assert s in worker_shards(n, total, g)
    # the largest g with g*N//G <= s, by brute force
    assert g == max(w for w in range(total) if (w * n) // total <= s)


@settings(max_examples=250, deadline=None)
@given(rescale=rescales(), data=st.data())
def test_old_workers_to_read_equals_the_brute_force_loop(rescale, data) -> None:
    n, old_total, new_total = rescale
    w = data.draw(st.integers(0, new_total - 1))
    needed = old_workers_to_read(n, old_total, new_total, w)
    assert list(needed) == _overlap(n, new_total, w, old_total)
    # the old workers' shards cover the new worker's, and the count is bounded by the ratio
    covered = {s for g in needed for s in worker_shards(n, old_total, g)}
    assert set(worker_shards(n, new_total, w)) <= covered
    assert len(needed) <= -(-old_total // new_total) + 1


@settings(max_examples=250, deadline=None)
@given(rescale=rescales(), data=st.data())
def test_count_new_readers_equals_the_brute_force_count(rescale, data) -> None:
    n, old_total, new_total = rescale
    g = data.draw(st.integers(0, old_total - 1))
    readers = [w for w in range(new_total) if g in old_workers_to_read(n, old_total, new_total, w)]
    assert count_new_readers(n, old_total, new_total, g) == len(readers)
    assert readers == _overlap(n, old_total, g, new_total)


@settings(max_examples=60, deadline=None)
@given(rescale=rescales(max_shards=120))
def test_every_overlap_is_counted_once_from_both_sides(rescale) -> None:
    n, old_total, new_total = rescale
    from_new = sum(len(old_workers_to_read(n, old_total, new_total, w)) for w in range(new_total))
    from_old = sum(count_new_readers(n, old_total, new_total, g) for g in range(old_total))
    assert from_new == from_old


@settings(max_examples=8, deadline=None)
@given(
    topology=st.sampled_from([(40960, 32768, 24576), (40960, 32768, 40960), (30720, 24576, 30720)]),
    data=st.data(),
)
def test_inverse_maps_at_pretraining_scale(topology, data) -> None:
    n, old_total, new_total = topology
    w = data.draw(st.integers(0, new_total - 1))
    g = data.draw(st.integers(0, old_total - 1))
    assert list(old_workers_to_read(n, old_total, new_total, w)) == _overlap(
        n, new_total, w, old_total
    )
    assert count_new_readers(n, old_total, new_total, g) == len(
        _overlap(n, old_total, g, new_total)
    )


def test_bad_rescale_arguments_name_the_argument_and_fix() -> None:
    with pytest.raises(ValueError, match="new_worker=4 must be < new_total=4"):
        old_workers_to_read(10, 3, 4, 4)
    with pytest.raises(ValueError, match="old_worker=3 must be < old_total=3"):
        count_new_readers(10, 3, 4, 3)
    with pytest.raises(
        ValueError, match="n_logical_shards=30720 must be >= old_total=32768.*raise"
    ):
        old_workers_to_read(30720, 32768, 24576, 0)
    with pytest.raises(ValueError, match="n_logical_shards=8 must be >= new_total=9"):
        count_new_readers(8, 4, 9, 0)
    with pytest.raises(TypeError, match="old_total=2.0 must be an integer"):
        old_workers_to_read(8, 2.0, 4, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shard=10 must be < n_logical_shards=10"):
        shard_owner(10, 3, 10)
