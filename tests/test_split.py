"""The held-out evaluation split: which documents, stable across runs, topologies and added
files; train and eval readers partition every epoch; restore, rescale and refusal of another
split."""

from __future__ import annotations

import collections
import pickle
import shutil

import numpy as np
import pytest
from harness import check_restore_at_every_step, run
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_ext import DatasetIndex, ShardReader, World, merge_reader_states
from torchdata_ext.order.split import EvalSplit, heldout_documents
from torchdata_ext.testing import write_arrow_batches

SPLIT = EvalSplit(0.2, seed=7)


def make_docs(n: int, seed: int, base: int = 0, hi: int = 30) -> list[np.ndarray]:
    """Documents whose first token is a unique id, so content identifies them."""
    rng = np.random.default_rng(seed)
    return [
        np.concatenate(
            [[base + i + 1_000_000], rng.integers(10, 50_000, int(rng.integers(0, hi)))]
        ).astype(np.uint32)
        for i in range(n)
    ]


def write(root, docs, cuts) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for f in range(len(cuts) - 1):
        write_arrow_batches(str(root / f"part_{f}.arrow"), docs[cuts[f] : cuts[f + 1]])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """3 Arrow files, 600 documents."""
    root = tmp_path_factory.mktemp("split") / "web"
    docs = make_docs(600, 0)
    write(root, docs, [0, 150, 420, 600])
    return DatasetIndex.build(str(root)), docs


def ids(blocks) -> list[int]:
    """The unique first token of every whole document delivered."""
    return [int(d.data[0]) - 1_000_000 for b in blocks for d in b if d.start == 0]


def read_all(index, world_shape, n_shards=24, **kw) -> list[int]:
    R, W = world_shape
    out: list[int] = []
    for r in range(R):
        for w in range(W):
            reader = ShardReader(index, n_shards, world=World(r, R, w, W), epochs=1, **kw)
            out += ids(run(reader))
    return out


def heldout_ids(index, split) -> set[int]:
    """Held-out documents as their global position (the corpus order of this fixture)."""
    offsets = np.concatenate([[0], np.cumsum(index.doc_counts)])
    return {int(offsets[f]) + d for f, d in heldout_documents(index, split)}


# -- the pure function --------------------------------------------------------------------------
def test_mask_is_a_function_of_the_file_name_not_its_url() -> None:
    docs = np.arange(5000)
    a = SPLIT.mask("web", "/data/web/part_1.arrow", docs)
    assert np.array_equal(a, SPLIT.mask("web", "s3://bucket/mirror/web/part_1.arrow", docs))
    assert not np.array_equal(a, SPLIT.mask("web", "/data/web/part_2.arrow", docs))
    assert not np.array_equal(a, SPLIT.mask("code", "/data/web/part_1.arrow", docs))
    assert not np.array_equal(a, EvalSplit(0.2, seed=8).mask("web", "/x/part_1.arrow", docs))
    assert abs(a.mean() - 0.2) < 0.02  # each document held out with probability 0.2
    # a run of documents gives the same answer as each document alone
    assert [bool(SPLIT.mask("web", "part_1.arrow", np.array([d]))[0]) for d in range(50)] == list(
        a[:50]
    )


@settings(max_examples=40, deadline=None)
@given(
    f1=st.floats(0, 1),
    f2=st.floats(0, 1),
    seed=st.integers(-(2**40), 2**40),
    name=st.text(min_size=1, max_size=12),
)
def test_a_larger_fraction_holds_out_a_superset(f1, f2, seed, name) -> None:
    lo, hi = sorted((f1, f2))
    docs = np.arange(2000)
    small = EvalSplit(lo, seed).mask("d", name, docs)
    large = EvalSplit(hi, seed).mask("d", name, docs)
    assert not (small & ~large).any()
    assert not EvalSplit(0.0, seed).mask("d", name, docs).any()
    assert EvalSplit(1.0, seed).mask("d", name, docs).all()


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.1", True, float("nan")])
def test_bad_fraction_names_the_argument(bad) -> None:
    with pytest.raises(ValueError, match="eval_fraction"):
        EvalSplit(bad)


# -- readers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (1, 3)], ids=str)
@pytest.mark.parametrize("kw", [{}, {"block_docs": 5}, {"max_chunksize": 7, "block_docs": 4}])
def test_train_and_eval_partition_the_epoch(corpus, shape, kw) -> None:
    index, docs = corpus
    held = heldout_ids(index, SPLIT)
    assert 80 < len(held) < 160
    train = read_all(index, shape, split=SPLIT, subset="train", **kw)
    evald = read_all(index, shape, split=SPLIT, subset="eval", **kw)
    assert collections.Counter(evald) == collections.Counter(held)  # each once, exactly these
    assert collections.Counter(train) == collections.Counter(set(range(len(docs))) - held)


def test_delivered_documents_are_whole_and_exact(corpus) -> None:
    index, docs = corpus
    got = {}
    for b in run(
        ShardReader(index, 8, world=World(0, 1, 0, 1), epochs=1, split=SPLIT, subset="eval")
    ):
        for d in b:
            got[int(d.data[0]) - 1_000_000] = d.data.tolist()
    assert got == {i: docs[i].tolist() for i in heldout_ids(index, SPLIT)}


def test_split_is_the_same_when_a_file_is_added(corpus, tmp_path) -> None:
    index, docs = corpus
    root = tmp_path / "web"
    shutil.copytree(index.files[0].rsplit("/", 1)[0], root)
    more = make_docs(100, 1, base=600)
    write_arrow_batches(str(root / "part_3.arrow"), more)
    bigger = DatasetIndex.build(str(root))
    assert len(bigger.files) == 4
    old = heldout_ids(index, SPLIT)
    new = heldout_ids(bigger, SPLIT)
    assert {i for i in new if i < 600} == old
    assert any(i >= 600 for i in new)
    # and the readers agree, whatever the shard count
    assert set(read_all(bigger, (2, 1), n_shards=30, split=SPLIT, subset="eval")) == new


@pytest.mark.parametrize("subset", ["train", "eval"])
def test_restore_at_every_step(corpus, subset) -> None:
    index, _ = corpus

    def make():
        return ShardReader(
            index, 6, world=World(1, 2, 0, 1), epochs=2, block_docs=9, split=SPLIT, subset=subset
        )

    items = check_restore_at_every_step(make)
    assert items


@pytest.mark.parametrize(("before", "after"), [((2, 2), (3, 1)), ((1, 3), (2, 2))], ids=str)
def test_rescale_keeps_the_split(corpus, before, after) -> None:
    index, docs = corpus
    held = heldout_ids(index, SPLIT)
    for subset, expected in (("train", set(range(len(docs))) - held), ("eval", held)):
        seen: list[int] = []
        states = []
        r0, w0 = before
        for r in range(r0):
            for w in range(w0):
                reader = ShardReader(
                    index, 24, world=World(r, r0, w, w0), epochs=1, block_docs=3, split=SPLIT,
                    subset=subset,
                )  # fmt: skip
                seen += ids(run(reader, 2 + 3 * r + w))
                states.append(pickle.loads(pickle.dumps(reader.state_dict())))
        merged = merge_reader_states(states)
        r1, w1 = after
        for r in range(r1):
            for w in range(w1):
                reader = ShardReader(
                    index, 24, world=World(r, r1, w, w1), epochs=1, split=SPLIT, subset=subset
                )
                reader.reset(merged)
                seen += ids(run(reader))
        assert collections.Counter(seen) == collections.Counter(expected), subset


def test_state_records_the_split_and_refuses_another(corpus) -> None:
    index, _ = corpus
    reader = ShardReader(index, 6, world=World(0, 1, 0, 1), split=SPLIT)
    run(reader, 3)
    state = reader.state_dict()
    assert state["split"] == {"eval_fraction": 0.2, "seed": 7, "subset": "train"}
    for kw in (
        {},
        {"split": EvalSplit(0.1, seed=7)},
        {"split": EvalSplit(0.2, seed=8)},
        {"split": SPLIT, "subset": "eval"},
    ):
        other = ShardReader(index, 6, world=World(0, 1, 0, 1), **kw)
        with pytest.raises(ValueError, match="held-out evaluation split differs"):
            other.reset(state)
    plain = ShardReader(index, 6, world=World(0, 1, 0, 1)).state_dict()
    assert plain["split"] is None
    with pytest.raises(ValueError, match="split"):
        merge_reader_states([state, {**plain, "shards": {}}], complete=False)


def test_reader_arguments_are_checked(corpus) -> None:
    index, _ = corpus
    with pytest.raises(ValueError, match="subset='eval' needs a split"):
        ShardReader(index, 6, subset="eval")
    with pytest.raises(ValueError, match="subset="):
        ShardReader(index, 6, split=SPLIT, subset="test")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EvalSplit"):
        ShardReader(index, 6, split=0.1)  # type: ignore[arg-type]


def test_endless_eval_reader_with_nothing_held_out_says_why(corpus) -> None:
    index, _ = corpus
    reader = ShardReader(index, 6, world=World(0, 1, 0, 1), split=EvalSplit(0.0), subset="eval")
    with pytest.raises(ValueError, match="epochs=1 for evaluation"):
        next(iter(reader))
