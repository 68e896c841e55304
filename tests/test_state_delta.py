"""State deltas: ``apply(prev, diff(prev, cur))`` equals ``cur`` and leaves ``prev`` as it was."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_ext import World
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.state.delta import PATCH, SET, apply, diff
from torchdata_ext.testing import write_arrow_batches, write_jsonl

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


def plain(state):
    """A state as it is saved or sent (pickled): lazily built parts (the shuffle buffer's
    provenance blocks) become the plain tuples they stand for."""
    return pickle.loads(pickle.dumps(state))


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


@settings(max_examples=150, deadline=None)
@given(trees, trees)
def test_apply_of_diff_gives_the_new_state_and_keeps_the_old(prev, cur) -> None:
    before = copy.deepcopy(prev)
    ops = diff(prev, cur)
    # what a worker sends crosses a process: the delta is pickled
    out = apply(prev, pickle.loads(pickle.dumps(ops)))
    assert same(out, cur)
    assert same(prev, before)


@settings(max_examples=60, deadline=None)
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


# -- the contract the diff relies on, over real pipelines -----------------------------------------
@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("delta")
    rng = np.random.default_rng(8)
    for name, n_docs, mean in (("web", 90, 30), ("code", 40, 90), ("books", 8, 250)):
        docs = [
            rng.integers(5, 30_000, max(1, int(rng.exponential(mean))), dtype=np.uint32)
            for _ in range(n_docs)
        ]
        write_arrow_batches(str(root / name / "part_0.arrow"), docs[: n_docs // 2])
        write_arrow_batches(str(root / name / "part_1.arrow"), docs[n_docs // 2 :])
    write_jsonl(str(root / "prose" / "p.jsonl"), [f"text {i} " * (i % 13 + 1) for i in range(60)])
    return str(root)


CONFIGS = {
    "concat": {},
    "pad_chunks": dict(pack_mode="pad", max_chunksize=40),
    "best_fit": dict(pack_mode="best_fit", best_fit_window=9),
    "samples_no_buffer": dict(interleave_mode="samples", shuffle_buffer=1),
    "phases_budgets": dict(
        datasets="",
        weights="",
        max_tokens={"books": 900},
        phases=[{"datasets": "web", "max_tokens": 700}, {"datasets": "code,books"}],
    ),  # fmt: skip
    "text": dict(
        datasets="prose", weights="1", file_type="jsonl", col_name="text", tokenizer="byte"
    ),
    "chunk_transforms": dict(
        pack_mode="chunk", max_chunksize=40, transforms=[{"min_length": 3}, {"truncate": 100}]
    ),
    "text_transforms": dict(
        datasets="prose",
        weights="1",
        file_type="jsonl",
        col_name="text",
        tokenizer="byte",
        transforms=[{"min_length": 30}],
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_states_are_never_mutated_and_deltas_rebuild_them_at_every_step(data_path, name) -> None:
    """At every step of real pipelines: no state handed out earlier changes afterwards (what
    lets the diff skip identical objects), and the state rebuilt from the deltas a worker
    sends is the graph's state."""
    kw = dict(
        data_path=data_path, datasets="web,code,books", weights="3,1,1", seq_length=48,
        eos_token=0, logical_shards=4, batch_size=3, seed=4, shuffle_buffer=21, block_docs=5,
        epochs=2,
    )  # fmt: skip
    kw.update(CONFIGS[name])
    node = build_pipeline(PipelineConfig(**kw), World())
    node.reset()
    held: list[tuple[Any, Any]] = []
    sent, rebuilt = None, None
    steps = 0
    while True:
        state = node.state_dict()
        rebuilt = apply(rebuilt, pickle.loads(pickle.dumps(diff(sent, state))))
        assert same(plain(rebuilt), plain(state)), steps
        sent = state
        held.append((state, copy.deepcopy(state)))
        try:
            next(node)
        except StopIteration:
            break
        steps += 1
    assert steps > 10
    for i, (state, frozen) in enumerate(held):
        assert same(plain(state), frozen), f"the state of step {i} changed after it was taken"


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 300),
    st.sampled_from([np.int8, np.int16, np.int64, np.uint8, np.bool_]),
    st.lists(st.integers(0, 299), max_size=12),
    st.booleans(),
)
def test_a_few_changed_array_elements_are_sent_as_a_patch(n, dtype, where, nested) -> None:
    prev_arr = (np.arange(n) % 7).astype(dtype)
    prev_arr.flags.writeable = False  # as the reader hands out its cursor columns
    cur_arr = prev_arr.copy()
    at = [i for i in where if i < n]
    cur_arr[at] = 1 if dtype is np.bool_ else 5
    prev = {"cursors": {"pos": prev_arr}, "x": 1} if nested else prev_arr
    cur = {"cursors": {"pos": cur_arr}, "x": 1} if nested else cur_arr
    ops = pickle.loads(pickle.dumps(diff(prev, cur)))
    out = apply(prev, ops)
    assert same(out, cur)
    got = out["cursors"]["pos"] if nested else out
    assert same(prev_arr, (np.arange(n) % 7).astype(dtype))  # the old array is untouched
    changed = int((cur_arr != prev_arr).sum())
    if changed and changed * 40 < n:  # a few of many: their places and values, not the array
        assert [op[1] for op in ops] == [PATCH]
        assert len(pickle.dumps(ops)) < 100 + 20 * changed
    assert not changed or got is not prev_arr


def test_after_a_restore_deltas_are_taken_against_the_restored_state(data_path) -> None:
    """A worker restored from a state sends its first delta against that state (the receiver
    starts from it too): for a restored shuffle buffer only the groups of the slots drawn
    since, and applying the deltas to the restored state gives the graph's state at every
    step."""
    from torchdata_ext.state.delta import _plain

    kw = dict(
        data_path=data_path, datasets="web,code,books", weights="3,1,1", seq_length=16,
        eos_token=0, logical_shards=4, batch_size=1, seed=4, shuffle_buffer=600, block_docs=5,
    )  # fmt: skip
    node = build_pipeline(PipelineConfig(**kw), World())
    node.reset()
    for _ in range(700):
        next(node)
    restored = plain(node.state_dict())
    node = build_pipeline(PipelineConfig(**kw), World())
    node.reset(plain(restored))
    sent, rebuilt = restored, restored
    for step in range(20):
        next(node)
        state = node.state_dict()
        ops = diff(sent, state)
        if step == 0:  # one draw: one block of the buffer's 3 groups of 64 blocks
            (path, kind, value), *rest = [op for op in ops if "prov_groups" in op[0]]
            # inside the list of groups: one group (or one block of it) set, not the list
            assert not rest and path[-1] != "prov_groups" and kind == SET, ops
            assert len(_plain(value)) in (2, 64), value
        rebuilt = apply(rebuilt, pickle.loads(pickle.dumps(ops)))
        assert same(plain(rebuilt), plain(state)), step
        sent = state


@pytest.mark.parametrize("slack", [1024, 3])
def test_a_shuffle_buffer_sends_the_slots_drawn_and_the_receiver_journals_them(
    data_path, monkeypatch, slack
) -> None:
    """A worker's delta for the shuffle buffer's provenance is the journal's changes since the
    state before (a CHANGE op: the slots drawn and their tables), at every step after the
    first, across the journal's rebuilds on the worker's side (slack 3: one every few draws)
    and on the receiver's; the receiver's state pickles as the worker's, read at once or
    later, nothing of it is built before it is read, and its journal stays bounded."""
    from torchdata_ext.nodes import shuffle_state
    from torchdata_ext.nodes.shuffle_state import JournalDelta, LazyGroups
    from torchdata_ext.state.delta import CHANGE

    monkeypatch.setattr(shuffle_state, "JOURNAL_SLACK", slack)
    kw = dict(
        data_path=data_path, datasets="web,code,books", weights="3,1,1", seq_length=16,
        eos_token=0, logical_shards=4, batch_size=2, seed=4, shuffle_buffer=40, block_docs=5,
        epochs=2,
    )  # fmt: skip
    node = build_pipeline(PipelineConfig(**kw), World())
    node.reset()
    sent, rebuilt, held = None, None, []
    kinds: list[int] = []
    steps = 0
    while True:
        state = node.state_dict()
        ops = pickle.loads(pickle.dumps(diff(sent, state)))
        prov = [op for op in ops if "prov_groups" in op[0]]
        if (
            sent is not None
            and "prov_groups" in sent["source"]
            and "prov_groups" in state["source"]
        ):
            assert [op[1] for op in prov] in ([CHANGE], []), (steps, prov)
            kinds += [op[1] for op in prov]
        rebuilt = apply(rebuilt, ops)
        groups = rebuilt["source"].get("prov_groups")
        if type(groups) is LazyGroups:
            assert not groups.built  # nothing is built on the receiver until read
            assert len(groups.journal) <= 2 * 40 + slack + 2, len(groups.journal)
        held.append((rebuilt, plain(state)))
        if steps % 7 == 0:  # read (saved) now: the states after it build on it
            assert same(plain(rebuilt), held[-1][1]), steps
        sent = state
        try:
            next(node)
        except StopIteration:
            break
        steps += 1
    assert kinds.count(CHANGE) > 100
    # read afterwards, in reverse order: each received state is the worker's state at its step
    for i, (got, want) in reversed(list(enumerate(held))):
        assert same(plain(got), want), i
    # a delta applied to a state it was not taken against is refused by name
    delta = next(op[2] for op in diff(held[-3][0], held[-2][0]) if op[1] == CHANGE)
    assert isinstance(delta, JournalDelta)
    with pytest.raises(ValueError, match="provenance delta from"):
        delta._replace(n_prev=delta.n_prev + 1).apply_to(held[-3][0]["source"]["prov_groups"])
