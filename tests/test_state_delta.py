"""State deltas: ``apply(prev, diff(prev, cur))`` equals ``cur`` and leaves ``prev`` as it was."""

from __future__ import annotations

import copy
import pickle

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_ext.state_delta import SET, apply, diff

scalars = st.one_of(
    st.integers(-(2**40), 2**40), st.booleans(), st.none(), st.text(max_size=3), st.floats(0, 1)
)
arrays = st.lists(st.integers(-5, 5), max_size=6).map(lambda v: np.asarray(v, np.int64))
trees = st.recursive(
    st.one_of(scalars, arrays),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.sampled_from("abcdef"), inner, max_size=5),
        st.tuples(inner, inner),
    ),
    max_leaves=25,
)


def same(a, b) -> bool:
    """Deep equality that tells apart types (True vs 1, list vs tuple) and compares arrays."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


@settings(max_examples=300, deadline=None)
@given(trees, trees)
def test_apply_of_diff_gives_the_new_state_and_keeps_the_old(prev, cur) -> None:
    before = copy.deepcopy(prev)
    ops = diff(prev, cur)
    # what a worker sends crosses a process: the delta is pickled
    out = apply(prev, pickle.loads(pickle.dumps(ops)))
    assert same(out, cur)
    assert same(prev, before)


@settings(max_examples=150, deadline=None)
@given(st.lists(trees, min_size=2, max_size=6))
def test_a_chain_of_deltas_and_every_intermediate_state_stays_valid(states) -> None:
    held, now = [], None
    for s in states:
        now = apply(now, diff(held[-1][0] if held else None, s))
        held.append((s, now, copy.deepcopy(now)))
    for want, got, frozen in held:
        assert same(got, want) and same(got, frozen)


def test_unchanged_objects_are_skipped_by_identity_and_only_changes_are_sent() -> None:
    shards = {str(i): {"epoch": 0, "pos": i} for i in range(1000)}
    blocks = [np.arange(4) + i for i in range(2500)]
    prev = {"reader": {"shards": shards}, "buffer": blocks, "draws": 10}
    cur_shards = dict(shards)
    cur_shards["7"] = {"epoch": 0, "pos": 99}
    cur_blocks = list(blocks)
    cur_blocks[3] = np.arange(5)
    cur = {"reader": {"shards": cur_shards}, "buffer": cur_blocks, "draws": 11}
    ops = diff(prev, cur)
    assert sorted((p, k) for p, k, _ in ops) == [
        (("buffer", 3), SET),
        (("draws",), SET),
        (("reader", "shards", "7", "pos"), SET),
    ]
    assert len(pickle.dumps(ops)) < 1000
    out = apply(prev, ops)
    assert out["buffer"][4] is blocks[4] and out["reader"]["shards"]["8"] is shards["8"]
    assert prev["draws"] == 10 and prev["reader"]["shards"]["7"]["pos"] == 7
