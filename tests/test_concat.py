"""Concat: phases delivered in order (exhausted or on a budget), restored at every step,
documents fetched through the phase that reads them, a dataset in two phases refused."""

from __future__ import annotations

import numpy as np
import pytest
from harness import check_restore_at_every_step, run

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.nodes.concat import Concat
from torchdata_ext.nodes.interleave import Interleave
from torchdata_ext.nodes.take import Take
from torchdata_ext.testing import write_arrow_batches


@pytest.fixture(scope="module")
def indexes(tmp_path_factory) -> dict[str, DatasetIndex]:
    root = tmp_path_factory.mktemp("concat")
    rng = np.random.default_rng(1)
    out = {}
    for k, name in enumerate(("a", "b", "c")):
        docs = [
            100_000 * k + 100 * d + np.arange(1 + int(rng.integers(0, 30)), dtype=np.uint32)
            for d in range(10 + 5 * k)
        ]
        write_arrow_batches(str(root / name / "p0.arrow"), docs)
        out[name] = DatasetIndex.build(str(root / name), name=name)
    return out


def reader(index, epochs=1, chunk=None) -> ShardReader:
    return ShardReader(
        index, 4, seed=2, world=World(), epochs=epochs, block_docs=4, max_chunksize=chunk
    )


def pieces(blocks) -> list:
    return [p for b in blocks for p in b.pieces()]


def test_phases_come_in_order_each_whole(indexes) -> None:
    """Phase 0 (a alone, exhausted), then phase 1 (b and c mixed, exhausted): the stream is
    a's stream, then the mix's stream, each exactly as delivered alone."""
    a_alone = pieces(run(reader(indexes["a"])))
    mix_alone = pieces(
        run(Interleave({"b": reader(indexes["b"]), "c": reader(indexes["c"])}, {"b": 1, "c": 2}))
    )
    node = Concat(
        [
            reader(indexes["a"]),
            Interleave({"b": reader(indexes["b"]), "c": reader(indexes["c"])}, {"b": 1, "c": 2}),
        ]
    )
    node.reset()
    assert node.phase == 0
    got = pieces(run(node))
    assert got == a_alone + mix_alone
    assert node.phase == 2


@pytest.mark.parametrize("chunk", [None, 8])
def test_a_budgeted_phase_switches_after_exactly_n_tokens(indexes, chunk) -> None:
    """Phase 0 is endless a under a budget of 150 tokens, then b: exactly a's first 150
    tokens (the last document cut), then b from its start."""
    a_ref = run(reader(indexes["a"], epochs=None, chunk=chunk), 40)
    a_tokens = np.concatenate([b.tokens for b in a_ref])[:150]
    b_alone = pieces(run(reader(indexes["b"], chunk=chunk)))
    node = Concat(
        [
            Take(reader(indexes["a"], epochs=None, chunk=chunk), max_tokens=150, world=World()),
            reader(indexes["b"], chunk=chunk),
        ]
    )
    got = run(node)
    in_a = [b for b in got if b.dataset == "a"]
    assert [b.dataset for b in got] == ["a"] * len(in_a) + ["b"] * (len(got) - len(in_a))
    np.testing.assert_array_equal(np.concatenate([b.tokens for b in in_a]), a_tokens)
    assert pieces(got[len(in_a) :]) == b_alone


@pytest.mark.parametrize("chunk", [None, 8])
def test_restore_at_every_step(indexes, chunk) -> None:
    def make() -> Concat:
        return Concat(
            [
                Take(reader(indexes["a"], epochs=None, chunk=chunk), max_documents=7, name="p0"),
                Interleave(
                    {
                        "b": reader(indexes["b"], chunk=chunk),
                        "c": reader(indexes["c"], chunk=chunk),
                    },
                    {"b": 1, "c": 1},
                ),
            ]
        )

    items = check_restore_at_every_step(make)
    assert {b.dataset for b in items} == {"a", "b", "c"}


def test_fetch_document_goes_to_the_phase_reading_it(indexes) -> None:
    node = Concat([reader(indexes["a"]), Take(reader(indexes["b"]), max_tokens=5)])
    node.reset()
    np.testing.assert_array_equal(node.fetch_document("b", 0, 3), 100_000 + 300 + np.arange(
        len(node.fetch_document("b", 0, 3))))  # fmt: skip
    with pytest.raises(KeyError, match="'z'"):
        node.fetch_document("z", 0, 0)


def test_bad_phases_are_refused(indexes) -> None:
    with pytest.raises(ValueError, match="phases is empty"):
        Concat([])
    with pytest.raises(TypeError, match=r"phases\[1\]"):
        Concat([reader(indexes["a"]), "b"])  # type: ignore[list-item]
    r = reader(indexes["a"])
    with pytest.raises(ValueError, match="same node twice"):
        Concat([r, r])
    with pytest.raises(ValueError, match="dataset 'a' is read in phase 0 and phase 1"):
        Concat([reader(indexes["a"]), Interleave({"a": reader(indexes["a"])}, {"a": 1})])
    node = Concat([reader(indexes["a"])])
    node.reset()
    with pytest.raises(ValueError, match="restore with the same phases"):
        Concat([reader(indexes["a"]), reader(indexes["b"])]).reset(node.state_dict())
