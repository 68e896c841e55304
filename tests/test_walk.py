"""The random walk is a seeded permutation of [0, n) with random access."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_ext.order.walk import RandomWalk, mix_seed


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 10**6), seed=st.integers(-(2**63), 2**63 - 1))
def test_walk_is_a_permutation_for_any_n(n: int, seed: int) -> None:
    walk = RandomWalk(n, seed)
    out = walk.take(0, n)
    assert out.dtype == np.int64
    assert np.array_equal(np.sort(out), np.arange(n))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**32), data=st.data())
def test_random_access_matches_sequential(n: int, seed: int, data: st.DataObject) -> None:
    walk = RandomWalk(n, seed)
    full = walk.take(0, n)
    start = data.draw(st.integers(0, n - 1))
    count = data.draw(st.integers(0, n - start))
    assert np.array_equal(walk.take(start, count), full[start : start + count])
    assert walk[start] == full[start]
    assert list(walk) == full.tolist()


def test_small_n_edge_cases() -> None:
    assert RandomWalk(0, 1).take(0, 0).tolist() == []
    for n in range(1, 70):
        assert sorted(RandomWalk(n, n).take(0, n).tolist()) == list(range(n))


def test_seed_changes_order_and_same_seed_repeats() -> None:
    a = RandomWalk(10_000, 1).take(0, 10_000)
    b = RandomWalk(10_000, 2).take(0, 10_000)
    assert np.array_equal(a, RandomWalk(10_000, 1).take(0, 10_000))
    assert (a != b).mean() > 0.99
    # looks shuffled: not close to identity, displacement spread over the range
    assert abs(np.corrcoef(a, np.arange(10_000))[0, 1]) < 0.05


def test_out_of_range_and_bad_n() -> None:
    walk = RandomWalk(5, 0)
    import pytest

    with pytest.raises(IndexError):
        walk[5]
    with pytest.raises(IndexError):
        walk.take(3, 3)
    with pytest.raises(ValueError, match="n=-1"):
        RandomWalk(-1, 0)


def test_mix_seed_depends_on_every_value_and_order() -> None:
    seen = {mix_seed(s, sh, ep) for s in range(4) for sh in range(8) for ep in range(8)}
    assert len(seen) == 4 * 8 * 8
    assert mix_seed(1, 2) != mix_seed(2, 1)
    assert 0 <= mix_seed(-5, 2**70) < 2**63


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 20_000), seed=st.integers(0, 2**63 - 1), data=st.data())
def test_table_and_direct_feistel_give_the_same_walk(
    n: int, seed: int, data: st.DataObject
) -> None:
    start = data.draw(st.integers(0, n - 1))
    count = data.draw(st.integers(0, n - start))
    table = RandomWalk(n, seed).take(start, count)
    assert np.array_equal(RandomWalk(n, seed, max_table=0).take(start, count), table)
