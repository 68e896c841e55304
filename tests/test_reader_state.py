"""Reader state format 2 (cursor columns, the active cursor, sparse extras) and format 1 still read.

Format 1 states are made here from format 2 ones by :func:`to_format1`, written from the format
1 layout (one dict per shard, keyed by ``str(shard_id)``), not with the library's reader.
"""

from __future__ import annotations

import collections
import pickle

import numpy as np
import pytest
from harness import check_exactly_once, document_lengths, item_key, run, write_random_arrow_datasets

from torchdata_ext import DatasetIndex, ShardReader, World, merge_reader_states
from torchdata_ext.checkpoint.rescale import rescale_worker_states
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.state.delta import diff
from torchdata_ext.state.graph import reader_states, set_at
from torchdata_ext.state.reader_state import reader_cursors
from torchdata_ext.testing import write_arrow_batches


def to_format1(state: dict) -> dict:
    """The format 1 state holding the same cursors as format 2 ``state``."""
    cols = state["cursors"]
    shards = {}
    for i, sid in enumerate(cols["ids"].tolist()):
        ex = state["extras"].get(str(sid), {})
        shards[str(sid)] = {
            "returned": [list(x) for x in ex.get("returned", [])],
            "epoch": int(cols["epoch"][i]),
            "pos": int(cols["pos"][i]),
            "offset": int(cols["offset"][i]),
            "skipped_files": list(ex.get("skipped_files", [])),
            "skipped_docs": [list(x) for x in ex.get("skipped_docs", [])],
            "skips": int(cols["skips"][i]),
        }
    active = state["active"]
    if active is not None:
        shards[str(active["shard"])] = {k: v for k, v in active.items() if k != "shard"}
    keys = ("dataset", "fingerprint", "seed", "n_logical_shards", "split")
    return {"format": 1, **{k: state[k] for k in keys}, "shards": shards}


def make_docs(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 50_000, int(rng.integers(1, 40)), dtype=np.uint32) for _ in range(n)]


def _corpus(tmp_path_factory, bounds: tuple[int, ...]):
    """Arrow files of ``bounds[-1]`` documents, file ``f`` holding ``bounds[f]:bounds[f + 1]``."""
    root = tmp_path_factory.mktemp("rs") / "web"
    root.mkdir()
    docs = make_docs(bounds[-1], 1)
    for f, (a, b) in enumerate(zip(bounds, bounds[1:])):
        write_arrow_batches(str(root / f"part_{f}.arrow"), docs[a:b])
    return DatasetIndex.build(str(root)), docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """3 Arrow files, 300 documents."""
    return _corpus(tmp_path_factory, (0, 90, 220, 300))


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """3 Arrow files, 120 documents: 10 a shard of 12, so still 3 blocks of 4 (the last one
    short) and chunks of 9 tokens in each shard, for a test that restores at every step (its
    time grows with the square of the steps: 14 s with the 300 documents, on one idle core)."""
    return _corpus(tmp_path_factory, (0, 36, 88, 120))


def keys(blocks) -> list[tuple]:
    return [tuple(d.data.tolist()) for b in blocks for d in b]


def test_format1_state_restores_exactly_at_every_step(small_corpus) -> None:
    index, docs = small_corpus

    def make():
        return ShardReader(
            index, 12, seed=3, world=World(), epochs=2, block_docs=4, max_chunksize=9
        )

    node = make()
    node.reset()
    states, items = [], []
    while True:
        states.append(pickle.dumps(to_format1(node.state_dict())))
        try:
            items.append(item_key(next(node)))
        except StopIteration:
            break
    assert len(items) > 20
    for k, blob in enumerate(states):
        old = pickle.loads(blob)
        assert old["format"] == 1 and "cursors" not in old
        fresh = make()
        fresh.reset(old)
        assert [item_key(x) for x in run(fresh)] == items[k:], f"differs after restore at {k=}"


@pytest.mark.parametrize("before,after", [((2, 2), (3, 1)), ((1, 3), (1, 1))], ids=str)
def test_format1_and_mixed_states_merge_and_rescale_exactly(corpus, before, after) -> None:
    index, docs = corpus
    seen: list[tuple] = []
    states = []
    r0, w0 = before
    for g in range(r0 * w0):
        reader = ShardReader(
            index, 12, world=World(g // w0, r0, g % w0, w0), epochs=1, block_docs=3
        )
        seen += keys(run(reader, 2 + 3 * g))
        st = reader.state_dict()
        states.append(to_format1(st) if g % 2 == 0 else st)  # old and new formats mixed
    merged = merge_reader_states(states)
    assert merged["format"] == 2
    only_old = merge_reader_states([to_format1(s) if s["format"] == 2 else s for s in states])
    view, view_old = reader_cursors(merged), reader_cursors(only_old)
    for k in ("ids", "epoch", "pos", "offset", "skips"):
        assert np.array_equal(getattr(view, k), getattr(view_old, k)), k
    assert view.extras == view_old.extras
    r1, w1 = after
    for g in range(r1 * w1):
        reader = ShardReader(index, 12, world=World(g // w1, r1, g % w1, w1), epochs=1)
        reader.reset(to_format1(merged) if g % 2 else merged)
        seen += keys(run(reader))
    assert collections.Counter(seen) == collections.Counter(tuple(d.tolist()) for d in docs)


def test_with_returned_reads_format1_and_hands_pieces_to_their_shards(corpus) -> None:
    index, docs = corpus
    reader = ShardReader(index, 12, world=World(), epochs=1)
    state = reader.state_dict()
    pieces = [(1, 5, 2, -1), (0, 3, 0, 4), (0, 3, 4, -1)]
    for st in (state, to_format1(state)):
        back = reader_cursors(reader.with_returned(st, pieces))
        got = {s: e["returned"] for s, e in back.extras.items()}
        # documents 3 (file 0) and 95 (file 1, doc 5) of 300: shards 0 and 3 of 12
        assert got == {0: [[0, 3, 0, 4], [0, 3, 4, -1]], 3: [[1, 5, 2, -1]]}


def test_cursor_columns_are_shared_until_a_shard_is_left_and_never_written(corpus) -> None:
    index, _ = corpus
    reader = ShardReader(index, 12, world=World(), epochs=2, block_docs=4)
    reader.reset()
    prev = reader.state_dict()
    snapshots = [(prev, pickle.dumps(prev))]
    rebuilt = 0
    for _ in range(60):
        next(reader)
        cur = reader.state_dict()
        ops = diff(prev, cur)
        if cur["cursors"] is prev["cursors"]:
            # only the active cursor (and the state dict holding it) changed
            assert all(path[0] == "active" for path, _, _ in ops), ops
        else:
            rebuilt += 1
            changed = {k for k in cur["cursors"] if cur["cursors"][k] is not prev["cursors"][k]}
            assert changed and "ids" not in changed  # only the columns that changed are new
        assert all(not a.flags.writeable for a in cur["cursors"].values())
        snapshots.append((cur, pickle.dumps(cur)))
        prev = cur
    assert 0 < rebuilt < 20  # 12 shards of ~25 documents: a few were left, most steps share
    for st, blob in snapshots:  # states handed out earlier are unchanged
        old = pickle.loads(blob)
        assert all(np.array_equal(st["cursors"][k], old["cursors"][k]) for k in old["cursors"])
        assert st["active"] == old["active"] and st["extras"] == old["extras"]


def test_state_is_columns_not_a_dict_per_shard(corpus) -> None:
    index, _ = corpus
    big = ShardReader(index, 300, world=World(), block_docs=2)
    run(big, 40)
    state = big.state_dict()
    new, old = len(pickle.dumps(state)), len(pickle.dumps(to_format1(state)))
    assert new * 4 < old, (new, old)  # 2.4 KB, not 11.5 KB


# -- the whole pipeline: format 1 readers inside worker graph states rescale exactly -------------
@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("rs_pipe")
    write_random_arrow_datasets(str(root), (("web", 90, 15), ("code", 50, 30)), seed=4)
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="2,1", seq_length=16, eos_token=0,
        bos_token=1, logical_shards=12, batch_size=2, seed=5, shuffle_buffer=4, block_docs=3,
        epochs=1, mix_quantum_tokens=0,
    )  # fmt: skip


def test_pipeline_with_format1_reader_states_rescales_exactly_once(cfg) -> None:
    names = ["web", "code"]
    coverage: dict = {}

    def cover(seqs) -> None:
        for seq in seqs:
            for ds, f, d, start, length in np.asarray(seq["provenance"]).tolist():
                if ds not in (LITERAL, PAD):
                    coverage.setdefault((names[ds], f, d), []).append((start, start + length))

    def build(world: World):
        return build_pipeline(cfg, world, collate=False)

    old_graphs = {}
    for g in range(4):  # 2 ranks x 2 workers, a few sequences each
        root = build(World(g // 2, 2, g % 2, 2))
        root.reset()
        cover(run(root, 3 + g))
        graph = root.state_dict()
        paths = reader_states(graph)
        assert paths
        for path, st in paths.items():
            set_at(graph, path, to_format1(st))
        old_graphs[g] = pickle.loads(pickle.dumps(graph))
    for g in range(3):  # -> 3 ranks x 1 worker
        world = World(g, 3, 0, 1)
        state = rescale_worker_states(old_graphs, (2, 2), world, build)
        assert all(st["format"] == 2 for st in reader_states(state).values())
        root = build(world)
        root.reset(state)
        cover(run(root))
    check_exactly_once(coverage, document_lengths(cfg))
