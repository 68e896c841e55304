"""Take: a budget of tokens or documents ends the stream exactly, split exactly among workers,
restored at every step, the cut block's tail held (and reported) rather than lost."""

from __future__ import annotations

import numpy as np
import pytest
from harness import check_restore_at_every_step, run
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.document import DocumentBlock
from torchdata_ext.nodes.take import Take, budget_share
from torchdata_ext.testing import write_arrow_batches


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> DatasetIndex:
    root = tmp_path_factory.mktemp("take")
    rng = np.random.default_rng(0)
    # document d of file f holds the tokens 1000 * (10 * d + f) + position: content is checkable
    for f in range(2):
        docs = [
            1000 * (10 * d + f) + np.arange(1 + int(rng.integers(0, 40)), dtype=np.uint32)
            for d in range(12)
        ]
        write_arrow_batches(str(root / f"p{f}.arrow"), docs)
    return DatasetIndex.build(str(root), name="a")


def reader(index, world=None, epochs=1, chunk=None, block_docs=5) -> ShardReader:
    return ShardReader(
        index, 6, seed=3, world=world or World(), epochs=epochs, block_docs=block_docs,
        max_chunksize=chunk,
    )  # fmt: skip


def pieces_and_tokens(blocks: list[DocumentBlock]) -> tuple[list, np.ndarray]:
    pieces = [p for b in blocks for p in b.pieces()]
    tokens = np.concatenate([b.tokens for b in blocks]) if blocks else np.zeros(0)
    return pieces, tokens


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 900), chunk=st.sampled_from([None, 7]))
def test_max_tokens_delivers_exactly_the_first_n_tokens(index, n, chunk) -> None:
    full = run(reader(index, epochs=None, chunk=chunk), 80)
    _, ref = pieces_and_tokens(full)
    got = run(Take(reader(index, epochs=None, chunk=chunk), max_tokens=n, world=World()))
    _, tokens = pieces_and_tokens(got)
    np.testing.assert_array_equal(tokens, ref[:n])
    ends = np.cumsum([int(x) for b in full for x in b.lengths])
    if got and n not in set(ends.tolist()):  # the budget ends inside a document's piece
        assert not got[-1].last[-1], "a document cut by the budget must not be marked ended"


@pytest.mark.parametrize("chunk", [None, 6])
@pytest.mark.parametrize("n", [0, 1, 5, 13, 24, 30])
def test_max_documents_delivers_whole_documents(index, n, chunk) -> None:
    full = run(reader(index, epochs=1, chunk=chunk))
    ref, _ = pieces_and_tokens(full)
    got, _ = pieces_and_tokens(run(Take(reader(index, chunk=chunk), max_documents=n)))
    starts = [i for i, p in enumerate(ref) if p[3] == 0]
    expected = ref if n >= len(starts) else ref[: starts[n]]
    assert got == expected  # the n-th document whole (all its pieces), nothing of the next
    assert sum(p[3] == 0 for p in got) == min(n, 24)


def test_both_budgets_end_at_the_first_to_run_out(index) -> None:
    full = run(reader(index, epochs=1))
    ref, ref_tokens = pieces_and_tokens(full)
    got, tokens = pieces_and_tokens(run(Take(reader(index), max_tokens=10_000, max_documents=3)))
    assert got == ref[:3]
    got, tokens = pieces_and_tokens(run(Take(reader(index), max_tokens=50, max_documents=30)))
    np.testing.assert_array_equal(tokens, ref_tokens[:50])


def test_a_finite_source_ending_first_ends_the_stream(index) -> None:
    full = run(reader(index, epochs=1))
    got = run(Take(reader(index), max_tokens=10**9))
    assert pieces_and_tokens(got)[0] == pieces_and_tokens(full)[0]


@pytest.mark.parametrize("total", [1, 3, 4])
def test_run_budget_is_split_exactly_among_workers(index, total) -> None:
    """Each global worker delivers its share; the shares sum to exactly the run's budget."""
    n = 301
    delivered = 0
    seen: set = set()
    for g in range(total):
        world = World(g, total, 0, 1)
        assert budget_share(n, world) in (n // total, n // total + 1)
        blocks = run(Take(reader(index, world, epochs=None), max_tokens=n, world=world))
        delivered += sum(b.num_tokens for b in blocks)
        for p in pieces_and_tokens(blocks)[0]:
            assert p not in seen
            seen.add(p)
    assert delivered == n


@pytest.mark.parametrize(
    "kw", [{"max_tokens": 77}, {"max_documents": 9}, {"max_tokens": 200, "max_documents": 11}]
)
@pytest.mark.parametrize("chunk", [None, 5])
def test_restore_at_every_step(index, kw, chunk) -> None:
    items = check_restore_at_every_step(
        lambda: Take(reader(index, epochs=None, chunk=chunk, block_docs=3), world=World(), **kw)
    )
    assert items  # and the cut (the last item) was restored too: the harness ends the stream


def test_the_cut_blocks_tail_is_held_and_reported(index) -> None:
    """inflight() reports the pieces pulled but not emitted: head + tail == the block, so a
    rescale hands the rest back instead of losing it; restoring the cut state reports it too."""
    import pickle

    ref = run(reader(index, epochs=1, block_docs=6))
    j = int(np.flatnonzero(ref[1].lengths >= 2)[0])  # cut piece j of the second block after 1
    n = ref[0].num_tokens + int(ref[1].offsets[j]) + 1
    node = Take(reader(index, block_docs=6), max_tokens=n)
    node.reset()
    got = run(node)
    assert [p for b in got for p in b.pieces()] == ref[0].pieces() + ref[1].pieces()[:j] + [
        (*ref[1].pieces()[j][:4], ref[1].pieces()[j][3] + 1)
    ]
    ds, f, d, start, stop = ref[1].pieces()[j]
    tail = node.inflight()
    assert tail == [(ds, f, d, start + 1, stop), *ref[1].pieces()[j + 1 :]]
    again = Take(reader(index, block_docs=6), max_tokens=n)
    again.reset(pickle.loads(pickle.dumps(node.state_dict())))
    assert again.inflight() == tail
    with pytest.raises(StopIteration):
        next(again)


def test_bad_arguments_are_named(index) -> None:
    with pytest.raises(ValueError, match="max_tokens or max_documents"):
        Take(reader(index))
    with pytest.raises(ValueError, match="max_tokens=-1 must be >= 0"):
        Take(reader(index), max_tokens=-1)
    with pytest.raises(TypeError, match="max_documents=1.5 must be an integer"):
        Take(reader(index), max_documents=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name=''"):
        Take(reader(index), max_tokens=1, name="")
    node = Take(reader(index), max_tokens=5)
    node.reset()
    with pytest.raises(ValueError, match="cannot be added or removed"):
        Take(reader(index), max_documents=5).reset(node.state_dict())
