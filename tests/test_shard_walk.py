"""The shard walk is one definition: the reader reads it, the vectorised listing agrees."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.order.shard_walk import shard_plan, walked_documents
from torchdata_ext.order.shards import file_offsets
from torchdata_ext.order.walk import RandomWalk, mix_seed, mix_seeds, walk_prefixes
from torchdata_ext.testing import write_arrow_batches


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(-(2**63), 2**64 - 1), min_size=0, max_size=6))
def test_mix_seeds_is_mix_seed_elementwise(values: list[int]) -> None:
    assert int(mix_seeds(*values)) == mix_seed(*values)
    signed = [v for v in values if v < 2**63]
    if signed:  # arrays of int64, broadcast against a scalar
        got = mix_seeds(7, np.array(signed, np.int64))
        assert got.tolist() == [mix_seed(7, v) for v in signed]


@settings(max_examples=60, deadline=None)
@given(
    walks=st.lists(
        st.tuples(st.integers(0, 5000), st.integers(0, 2**63 - 1), st.floats(0, 1)),
        min_size=1,
        max_size=12,
    )
)
def test_walk_prefixes_are_the_walks(walks: list[tuple[int, int, float]]) -> None:
    sizes = np.array([n for n, _, _ in walks], np.int64)
    seeds = np.array([s for _, s, _ in walks], np.uint64)
    counts = np.array([int(n * f) for n, _, f in walks], np.int64)
    got = walk_prefixes(sizes, seeds, counts)
    want = [RandomWalk(int(n), int(s)).take(0, int(c)) for n, s, c in zip(sizes, seeds, counts)]
    assert np.array_equal(got, np.concatenate(want))


@settings(max_examples=80, deadline=None)
@given(
    counts=st.lists(st.integers(0, 30), min_size=1, max_size=7),
    seed=st.integers(-(10**9), 10**9),
    epoch=st.integers(0, 5),
    data=st.data(),
)
def test_walked_documents_follow_each_shard_plan(
    counts: list[int], seed: int, epoch: int, data: st.DataObject
) -> None:
    offsets = file_offsets(counts)
    total = int(offsets[-1])
    if total == 0:
        return
    n = data.draw(st.integers(1, total))
    shards = np.arange(n)
    sizes = (shards + 1) * total // n - shards * total // n
    pos = np.array([data.draw(st.integers(0, int(s))) for s in sizes], np.int64)
    entry, file, doc = walked_documents(offsets, n, seed, shards, np.full(n, epoch), pos)
    for s in range(n):
        plan = shard_plan(offsets, n, seed, s, epoch)
        walk = [
            (f.file, f.start + int(d))
            for f, sd in zip(plan.fragments, plan.seeds)
            for d in RandomWalk(f.size, sd).take(0, f.size)
        ]
        assert len(walk) == sizes[s]
        ids = np.arange(s * total // n, (s + 1) * total // n)  # the shard's global documents
        f = np.searchsorted(offsets, ids, side="right") - 1
        assert sorted(walk) == list(zip(f.tolist(), (ids - offsets[f]).tolist()))
        mine = entry == s
        assert list(zip(file[mine].tolist(), doc[mine].tolist())) == walk[: pos[s]]


def test_the_reader_reads_the_listed_walk(tmp_path) -> None:
    """What a reader delivers, shard by shard in order, is :func:`walked_documents` of the
    whole shards (files split between shards, an empty file, several epochs)."""
    rng = np.random.default_rng(0)
    for f, n in enumerate((13, 0, 7, 22)):
        docs = [rng.integers(1, 99, 1 + int(rng.integers(0, 4)), dtype=np.uint32) for _ in range(n)]
        write_arrow_batches(str(tmp_path / f"p{f}.arrow"), docs)
    index = DatasetIndex.build(str(tmp_path))
    n_shards, seed = 6, 17
    reader = ShardReader(
        index, n_shards, seed=seed, world=World(0, 1, 0, 1), epochs=2, block_docs=4
    )
    reader.reset()
    seen: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for block in reader:
        for file, doc in zip(block.file.tolist(), block.doc.tolist()):
            seen.setdefault((block.epoch, block.shard), []).append((file, doc))
    offsets = file_offsets(index.doc_counts)
    for epoch in (0, 1):
        shards = np.arange(n_shards)
        sizes = (shards + 1) * 42 // n_shards - shards * 42 // n_shards
        entry, file, doc = walked_documents(offsets, n_shards, seed, shards, epoch, sizes)
        for s in range(n_shards):
            listed = list(zip(file[entry == s].tolist(), doc[entry == s].tolist()))
            assert listed == seen[(epoch, s)]
