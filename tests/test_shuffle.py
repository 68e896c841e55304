"""ShuffleBuffer: exact resume from provenance, nothing lost when draining, small state."""

from __future__ import annotations

import collections
import dataclasses
import pickle
from typing import Any

import numpy as np
import pytest
from harness import check_loader_restore, check_restore_at_every_step, item_key, run
from torchdata.nodes import BaseNode, IterableWrapper

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.nodes.pack import Pack, PackedSequence
from torchdata_ext.nodes.shuffle import DRAW_TAG, ProvenanceItem, ShuffleBuffer
from torchdata_ext.nodes.shuffle_state import (
    buffered_provenance,
    narrow,
    provenance_groups,
    state_blocks,
)
from torchdata_ext.order.walk import mix_seed
from torchdata_ext.provenance import resolve
from torchdata_ext.testing import write_arrow_batches


class OnePerDocument(BaseNode[dict]):
    """Test adapter: a reader's blocks -> one item per document with a provenance table."""

    def __init__(self, reader: ShardReader) -> None:
        super().__init__()
        self.reader = reader
        self._block: Any = None
        self._i = 0
        self._before: Any = None

    def reset(self, initial_state=None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.reader.reset(initial_state["source"])
            self._before = initial_state["source"]
            self._i = initial_state["consumed"]
            self._block = next(self.reader) if initial_state["has_block"] else None
        else:
            self.reader.reset(None)
            self._before, self._block, self._i = None, None, 0

    def next(self) -> dict:
        while self._block is None or self._i >= len(self._block):
            self._block = None
            self._before = self.reader.state_dict()
            self._block = next(self.reader)
            self._i = 0
        d = self._block[self._i]
        self._i += 1
        prov = np.array([[0, d.file, d.doc, d.start, len(d.data)]], np.int64)
        return {"input_ids": d.data, "provenance": prov}

    def get_state(self) -> dict:
        return {
            "source": self._before if self._block is not None else self.reader.state_dict(),
            "consumed": self._i,
            "has_block": self._block is not None,
        }

    def rebuild(self, prov: np.ndarray) -> dict:
        ids = resolve(prov, [self.reader.dataset.name], self.reader)
        return {"input_ids": ids, "provenance": np.asarray(prov, np.int64)}


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("shuf") / "web"
    rng = np.random.default_rng(1)
    docs = [
        np.concatenate([[1_000_000 + i], rng.integers(5, 9000, int(rng.integers(0, 30)))]).astype(
            np.uint32
        )
        for i in range(120)
    ]
    write_arrow_batches(str(root / "a.arrow"), docs[:70])
    write_arrow_batches(str(root / "b.arrow"), docs[70:])
    return DatasetIndex.build(str(root)), docs


def make(
    index, size: int, epochs: int | None = 1, seed: int = 3, fill: str = "stream"
) -> ShuffleBuffer:
    reader = ShardReader(index, 8, world=World(), epochs=epochs, block_docs=7, seed=1)
    return ShuffleBuffer(OnePerDocument(reader), size, seed=seed, fill=fill)


def test_drains_every_item_exactly_once_in_shuffled_order(index) -> None:
    idx, docs = index
    unshuffled = [int(x["input_ids"][0]) for x in run(make(idx, 1))]
    out = [int(x["input_ids"][0]) for x in run(make(idx, 40))]
    assert sorted(out) == sorted(unshuffled) == [1_000_000 + i for i in range(120)]
    assert out != unshuffled
    # far-apart neighbours: mean displacement well above what no buffer gives (0)
    pos = {v: i for i, v in enumerate(unshuffled)}
    assert np.mean([abs(pos[v] - i) for i, v in enumerate(out)]) > 10


@pytest.mark.parametrize("fill", ["stream", "full"])
def test_restore_at_every_step_rebuilds_from_provenance(index, fill) -> None:
    # stream: steps 0 .. 25 are during the fill (the state holds 0 .. 25 items)
    idx, _ = index
    items = check_restore_at_every_step(lambda: make(idx, 25, epochs=2, fill=fill))
    assert len(items) == 240


class _Counted(IterableWrapper):
    """An endless ``range`` that counts its pulls."""

    def __init__(self) -> None:
        super().__init__(range(10**9))
        self.pulls = 0

    def next(self):
        self.pulls += 1
        return super().next()


def test_a_streaming_fill_delivers_from_the_second_pull() -> None:
    src = _Counted()
    node = ShuffleBuffer(src, 1000, seed=4)
    node.reset()
    assert next(node) == 0 and src.pulls == 2  # one item added, the one drawn replaced
    for k in range(2, 1001):
        next(node)
        assert len(node._buf) == k and src.pulls == 2 * k
    next(node)  # full: one pull per draw from now on
    assert len(node._buf) == 1000 and src.pulls == 2001
    full = _Counted()
    node = ShuffleBuffer(full, 1000, seed=4, fill="full")
    node.reset()
    next(node)
    assert full.pulls == 1001  # the whole buffer first
    # once full, both modes draw alike: the same slots, from buffers of the same items
    a, b = ShuffleBuffer(_Counted(), 50, seed=4), ShuffleBuffer(_Counted(), 50, seed=4, fill="full")
    a.reset(), b.reset()
    for _ in range(50):
        next(a)
    next(b)
    assert sorted(a._buf) != sorted(b._buf)  # different items (the streamed ones left early)
    with pytest.raises(ValueError, match=r"fill='half' must be one of \('stream', 'full'\)"):
        ShuffleBuffer(IterableWrapper([]), 2, fill="half")


def test_state_holds_provenance_not_tokens(index) -> None:
    idx, _ = index
    node = make(idx, 50, epochs=None)
    for _ in range(30):
        next(node)
    held = [b for group in node.state_dict()["prov_groups"] for b in group]
    assert sum(int(c.sum()) for c, _ in held) == 30  # filling: one more item per draw
    for _ in range(30):
        next(node)
    state = node.state_dict()
    blocks = [b for group in state["prov_groups"] for b in group]
    assert "items" not in state and sum(int(c.sum()) for c, _ in blocks) == 50
    assert all(r.dtype.itemsize <= 4 for _, r in blocks)
    # format 2 (the blocks in one list) and format 1 (all items concatenated, one array per
    # column), as written by earlier versions
    v2 = {k: v for k, v in state.items() if k != "prov_groups"}
    v2["prov_blocks"] = [tuple(b) for b in blocks]
    v1 = {k: v for k, v in state.items() if k != "prov_groups"}
    rows = np.concatenate([r for _, r in blocks])
    v1["prov_counts"] = np.concatenate([c for c, _ in blocks])
    v1["prov_rows"] = [rows[:, c] for c in range(5)]
    olds = []
    for v in (v2, v1):
        olds.append(make(idx, 50, epochs=None))
        olds[-1].reset(pickle.loads(pickle.dumps(v)))
    fresh = make(idx, 50, epochs=None)
    fresh.reset(pickle.loads(pickle.dumps(state)))
    rest = [item_key(x) for x in run(node, 40)]
    assert [item_key(x) for x in run(fresh, 40)] == rest
    for old in olds:
        assert [item_key(x) for x in run(old, 40)] == rest


def test_groups_are_remade_only_where_slots_changed(index) -> None:
    """A state after a draw shares every untouched group and block with the state before it
    (what lets a worker's state delta look at a few groups), and the groups always list the
    buffer's blocks in slot order, also while the buffer fills and drains."""
    idx, _ = index
    node = make(idx, 600, epochs=1)
    node.reset()
    prev = None
    steps = 0
    while True:
        try:
            next(node)
        except StopIteration:
            break
        state = node.state_dict()
        groups = state.get("prov_groups")
        if groups is None:
            break
        blocks = [b for g in groups for b in g]
        n = len(node._buf)
        assert len(blocks) == -(-n // 4) and all(len(g) <= 64 for g in groups[:-1])
        want = [np.asarray(node._provenance(x)) for x in node._buf]
        got = np.concatenate([np.asarray(r, np.int64) for _, r in blocks])
        assert np.array_equal(got, np.concatenate(want).reshape(-1, 5))
        if prev is not None and len(prev) == len(groups):
            same = sum(a is b for a, b in zip(prev, groups))
            assert same >= len(groups) - 2  # one draw touches one slot: at most 2 groups
        prev = groups
        steps += 1
    assert steps > 100


def test_plain_items_without_provenance_and_loader(index) -> None:
    def make_plain():
        return ShuffleBuffer(IterableWrapper(range(100)), 10, seed=7)

    out = check_restore_at_every_step(make_plain)
    assert sorted(out) == list(range(100)) and out != list(range(100))
    check_loader_restore(lambda: make(index[0], 20, epochs=None), steps=60, at=[0, 5, 33])


def test_draws_are_uniform_over_the_buffer() -> None:
    # with an endless constant source, each slot is picked ~equally often
    picks = collections.Counter()
    node = ShuffleBuffer(IterableWrapper(range(10**9)), 8, seed=11)
    for _ in range(8000):
        v = next(node)
        picks[v % 8] += 1
    counts = np.array([picks[i] for i in range(8)])
    assert counts.min() > 800 and counts.max() < 1200


def _documented_draws(items: list[int], size: int, seed: int) -> list[int]:
    """The stream the module docstring promises, written out: grow by one item per draw
    until full, draw ``mix_seed(seed, DRAW_TAG, i) % len(buffer)``, replace the drawn slot
    from upstream, and once upstream ends move the last slot into the drawn one."""
    src, buf, out, exhausted = iter(items), [], [], False
    while True:
        if not exhausted and len(buf) < size:
            try:
                buf.append(next(src))
            except StopIteration:
                exhausted = True
        if not buf:
            return out
        j = mix_seed(seed, DRAW_TAG, len(out)) % len(buf)
        out.append(buf[j])
        if not exhausted:
            try:
                buf[j] = next(src)
                continue
            except StopIteration:
                exhausted = True
        buf[j] = buf[-1]
        buf.pop()


@pytest.mark.parametrize("seed", [0, 11, -3, 2**63 + 5])
def test_the_draws_are_the_documented_hash_through_a_restore(seed) -> None:
    """Draw ``i`` picks slot ``mix_seed(seed, DRAW_TAG, i) % len(buffer)`` (the slot hashes
    are made ahead in tables of 256: across a table's end, and from a state taken inside
    one), to the last item of a finite source."""
    items = list(range(1000, 1700))
    want = _documented_draws(items, 90, seed)
    node = ShuffleBuffer(IterableWrapper(items), 90, seed=seed)
    node.reset()
    got = [next(node) for _ in range(300)]
    state = node.state_dict()
    assert got == want[:300]
    again = ShuffleBuffer(IterableWrapper(items), 90, seed=seed)
    again.reset(state)
    assert got + list(again) == want and sorted(want) == items


def test_seed_and_bad_arguments(index) -> None:
    idx, _ = index
    a = [item_key(x) for x in run(make(idx, 30, seed=1))]
    b = [item_key(x) for x in run(make(idx, 30, seed=2))]
    assert a != b and sorted(a) == sorted(b)
    with pytest.raises(ValueError, match="buffer_size=0 must be >= 1"):
        ShuffleBuffer(IterableWrapper([]), 0)
    with pytest.raises(TypeError, match="buffer_size=2.0 must be an integer"):
        ShuffleBuffer(IterableWrapper([]), 2.0)  # type: ignore[arg-type]


# -- a Pack source: the buffer holds packed sequences --------------------------------------------
def _packed(index, size: int, epochs: int | None = 1, seq_len: int = 24) -> ShuffleBuffer:
    reader = ShardReader(index, 8, world=World(), epochs=epochs, block_docs=7, seed=1)
    return ShuffleBuffer(Pack(reader, seq_len, eos_token=0, shift=True), size, seed=5)


def _reference_state(node: ShuffleBuffer) -> list[tuple[np.ndarray, np.ndarray]]:
    """The provenance part of the state: per block of 4 slots, rows per item and the rows."""
    tables = [np.asarray(node.materialize(x)["provenance"]) for x in node._buf]
    out = []
    for b in range(0, len(tables), 4):
        part = tables[b : b + 4]
        counts = np.array([len(t) for t in part], np.int64)
        out.append((narrow(counts), narrow(np.concatenate(part).reshape(-1, 5))))
    return out


def test_packed_items_same_stream_and_state(index) -> None:
    idx, _ = index
    node = _packed(idx, 30)
    # the buffer holds the small form, and hands out what Pack.next would have
    plain = ShuffleBuffer(_HideProtocol(_packed(idx, 30).source), 30, seed=5)
    assert [item_key(x) for x in run(plain)] == [item_key(x) for x in run(_packed(idx, 30))]
    node.reset()
    steps = 0
    while True:
        state = node.state_dict()
        if node._buf:
            assert isinstance(node._buf[0], PackedSequence)
            want = _reference_state(node)
            for (counts, rows), (c, r) in zip(state_blocks(state), want, strict=True):
                assert counts.dtype == c.dtype and np.array_equal(counts, c)
                assert rows.dtype == r.dtype and np.array_equal(rows, r)
        try:
            next(node)
        except StopIteration:
            break
        steps += 1
    assert steps > 60  # filled, drew and drained
    n = len(run(_packed(idx, 12, epochs=2)))
    assert n > 100
    items = check_restore_at_every_step(lambda: _packed(idx, 12, epochs=2), steps=range(0, n, 7))
    assert len(items) == n


class _HideProtocol(BaseNode[dict]):
    """Passes a node's items through, hiding its next_packed/materialize."""

    def __init__(self, node: BaseNode) -> None:
        super().__init__()
        self.node = node
        self.rebuild = node.rebuild

    def reset(self, initial_state=None) -> None:
        super().reset(initial_state)
        self.node.reset(initial_state)

    def next(self) -> dict:
        return next(self.node)

    def get_state(self) -> dict:
        return self.node.state_dict()


class _Ticks:
    """A clock for torchdata_ext.progress that advances ``step`` seconds per reading."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_slow_fill_logs_its_progress_and_size(index, monkeypatch, caplog) -> None:
    idx, _ = index
    monkeypatch.setattr("torchdata_ext.progress._clock", _Ticks(1.0))  # 1 s per pull
    caplog.set_level("INFO", logger="torchdata_ext.nodes.shuffle")
    node = make(idx, 40, fill="full")
    next(node)
    lines = [r.getMessage() for r in caplog.records]
    # rate-limited: the first line after 2 s, then one per 10 s, and a closing line
    # what it waits for and the time left, as a warning: heard without a logging configuration
    what = "filling the shuffle buffer (the first batch comes once it is full)"
    assert lines[0] == f"{what}: 2 of 40 items after 2 s, about 38 s left"
    assert lines[1] == f"{what}: 12 of 40 items after 12 s, about 28 s left"
    assert lines[-1] == f"{what}: done, 40 of 40 items in 41.0 s"
    assert len(lines) == 5  # 2, 12, 22, 32 s and done
    assert [r.levelname for r in caplog.records] == ["WARNING"] * 4 + ["INFO"]
    caplog.clear()
    for _ in range(30):  # drawing from the full buffer is no wait
        next(node)
    assert caplog.records == []


def test_a_fast_fill_logs_nothing(index, caplog) -> None:
    idx, _ = index
    caplog.set_level("DEBUG", logger="torchdata_ext")
    node = make(idx, 40)
    node.worker_share = 500
    assert len(run(node)) == 120
    assert caplog.records == []


def _count_fetches(monkeypatch, node: type = ShardReader) -> list[Any]:
    """Every document ``node`` s read (or tokenize) again (``fetch_document``), as
    ``(file, doc)``, or ``(dataset, file, doc)`` for a node other than the reader."""
    fetched: list[Any] = []
    fetch = node.fetch_document

    def counting(self, dataset, file, doc):
        fetched.append((file, doc) if node is ShardReader else (dataset, file, doc))
        return fetch(self, dataset, file, doc)

    monkeypatch.setattr(node, "fetch_document", counting)
    return fetched


@pytest.mark.parametrize("packed", [False, True])
def test_a_restore_rebuilds_only_the_items_drawn(index, monkeypatch, caplog, packed) -> None:
    """A restored buffer holds provenance only: the restore reads no document, and each draw
    reads again only the documents of the restored item it hands out (items pulled since come
    from the reader's walk, not from fetches)."""
    idx, _ = index

    def build() -> ShuffleBuffer:
        return _packed(idx, 40) if packed else make(idx, 40)

    node = build()
    for _ in range(45):
        next(node)
    state = pickle.loads(pickle.dumps(node.state_dict()))
    restored_tables = [t.tolist() for t in np.split(*reversed(_flat(state)))]
    fetched = _count_fetches(monkeypatch)
    caplog.set_level("DEBUG", logger="torchdata_ext")
    fresh = build()
    fresh.reset(state)
    assert fetched == [] and caplog.records == []
    want = [item_key(x) for x in run(node, 10)]
    got = []
    for _ in range(10):
        before = len(fetched)
        item = next(fresh)
        got.append(item_key(item))
        prov = np.asarray(item["provenance"]).tolist()
        docs = {(f, d) for ds, f, d, _, n in prov if ds >= 0 and n > 0}
        if prov in restored_tables:  # a restored item: its documents read again, only them
            assert set(fetched[before:]) == docs and len(fetched) - before == len(docs)
        else:
            assert len(fetched) == before
    assert got == want
    everything = {(f, d) for t in restored_tables for ds, f, d, _, n in t if ds >= 0 and n > 0}
    assert 0 < len(set(fetched)) < len(everything)  # some restored items drawn, not all


def test_a_restored_text_buffer_tokenizes_only_the_rows_drawn(tmp_path, monkeypatch) -> None:
    """Text: the restore tokenizes none of the buffered rows' documents; each drawn restored
    row tokenizes its own documents again, and the stream is the uninterrupted one."""
    from harness import text_config, write_random_text_datasets

    from torchdata_ext.nodes.tokenize import Tokenize
    from torchdata_ext.pipeline.build import build_pipeline

    write_random_text_datasets(str(tmp_path), [("web", 90, 12), ("code", 50, 12)], ["ab"], 2)
    cfg = dataclasses.replace(text_config(str(tmp_path)), shuffle_buffer=20)

    def build() -> Any:
        return build_pipeline(cfg, World(), collate=False)

    node = build()
    node.reset()
    for _ in range(25):
        next(node)
    state = pickle.loads(pickle.dumps(node.state_dict()))
    names = ["web", "code"]
    restored = [t.tolist() for t in np.split(*reversed(_flat(state)))]
    fetched = _count_fetches(monkeypatch, Tokenize)
    fresh = build()
    fresh.reset(state)
    assert fetched == []
    want = [item_key(x) for x in run(node, 8)]
    got, drawn_docs = [], []
    for _ in range(8):
        item = next(fresh)
        got.append(item_key(item))
        prov = np.asarray(item["provenance"]).tolist()
        if prov in restored:  # each of its documents once (a document in two rows: twice)
            drawn_docs += sorted({(names[ds], f, d) for ds, f, d, _, n in prov if ds >= 0 and n})
    assert got == want
    assert drawn_docs and sorted(fetched) == sorted(drawn_docs)


def _flat(state: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(split points, rows)`` of a state's buffered provenance, for ``np.split``."""
    counts, rows = buffered_provenance(state)
    return np.cumsum(counts)[:-1], rows


def test_a_buffer_given_provenance_tables_rebuilds_them_when_drawn(index) -> None:
    """provenance_groups writes rows known by their provenance into a state (what a rescale
    hands on); the buffer restored from it delivers exactly those rows, rebuilt when drawn."""
    idx, _ = index
    source = _packed(idx, 1, epochs=None).source
    source.reset()
    rows = [source.next_packed() for _ in range(9)]
    tables = [r.provenance for r in rows]
    node = _packed(idx, 12, epochs=None)
    node.reset()
    state = node.state_dict()
    state["prov_groups"] = provenance_groups(tables)
    assert buffered_provenance(state)[0].tolist() == [len(t) for t in tables]
    node.reset(pickle.loads(pickle.dumps(state)))
    assert all(isinstance(x, ProvenanceItem) for x in node._buf)
    held = {item_key(source.materialize(r)): r for r in rows}
    drawn = [item_key(next(node)) for _ in range(60)]
    assert set(held) <= set(drawn)  # every handed-on row delivered, once
    assert all(drawn.count(k) == 1 for k in held)
    assert [len(c) for g in state["prov_groups"] for c, _ in g] == [4, 4, 1]


def test_a_buffer_larger_than_the_workers_share_warns_once(index, caplog) -> None:
    idx, _ = index
    calls = []

    def share() -> int:
        calls.append(1)
        return 30

    node = make(idx, 40)
    node.worker_share = share
    caplog.set_level("WARNING", logger="torchdata_ext.nodes.shuffle")
    run(node)
    node.reset()
    run(node)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and len(calls) == 1
    assert "holds 40 items but this worker's share of the data is only ~30" in warnings[0]
    caplog.clear()
    fits = make(idx, 30)
    fits.worker_share = 30
    run(fits)
    assert caplog.records == []


def test_the_pipeline_tells_the_buffer_the_workers_share(tmp_path, caplog) -> None:
    from torchdata_ext import PipelineConfig, build_pipeline

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 100, 50).astype(np.uint32) for _ in range(64)]  # 3,200 tokens
    write_arrow_batches(str(tmp_path / "web" / "a.arrow"), docs)
    cfg = PipelineConfig(
        data_path=str(tmp_path), datasets="web", weights="1", seq_length=16, eos_token=0,
        logical_shards=8, shuffle_buffer=60, batch_size=2, seed=1,
    )  # fmt: skip
    caplog.set_level("WARNING", logger="torchdata_ext.nodes.shuffle")
    # 3,200 tokens / (4 workers x 16) = 50 sequences < 60
    node = build_pipeline(cfg, World(rank=1, world_size=2, worker_id=0, num_workers=2))
    node.reset()
    next(node)
    assert "share of the data is only ~50" in caplog.text
    caplog.clear()
    node = build_pipeline(cfg, World(rank=0, world_size=1, worker_id=0, num_workers=1))
    node.reset()
    next(node)  # 200 sequences for one worker: fits
    assert caplog.text == ""


@pytest.mark.parametrize("slack", [1024, 3])
def test_states_taken_at_every_step_and_read_later_in_any_order(index, monkeypatch, slack) -> None:
    """The thread path takes a state after every batch and reads almost none of them; a worker
    reads each at once. Both mixed, while the buffer fills, draws and drains, and with the
    journal rebuilt into a new base often (slack 3): every state, read whenever and in any
    order, pickled or not, lists the buffer as it was when the state was taken."""
    from torchdata_ext.nodes import shuffle_state

    monkeypatch.setattr(shuffle_state, "JOURNAL_SLACK", slack)
    idx, _ = index
    node = _packed(idx, 10, epochs=2)
    node.reset()
    rng = np.random.default_rng(slack)
    taken: list[tuple[dict, list, int]] = []
    drawn = 0
    while True:
        state = node.state_dict()
        if node._buf:
            taken.append((state, _reference_state(node), drawn))
            if rng.random() < (0.3 if slack > 100 else 0.03):  # read now, as a worker delta does
                list(state_blocks(state))
        try:
            next(node)
        except StopIteration:
            break
        drawn += 1
    assert len(taken) > 60
    for i in rng.permutation(len(taken)):
        state, want, _ = taken[i]
        read = state if i % 2 else pickle.loads(pickle.dumps(state))
        got = state_blocks(read)
        assert len(got) == len(want), i
        for (counts, rows), (c, r) in zip(got, want, strict=True):
            assert counts.dtype == c.dtype and np.array_equal(counts, c), i
            assert rows.dtype == r.dtype and np.array_equal(rows, r), i
    # a state read long after it was taken restores the stream that followed it
    state, _, drawn = taken[len(taken) // 3]
    rest = [item_key(x) for x in run(_restored(idx, state))]
    replay = _packed(idx, 10, epochs=2)
    replay.reset()
    for _ in range(drawn):
        next(replay)
    assert rest == [item_key(x) for x in run(replay)]


def _restored(idx, state: dict) -> ShuffleBuffer:
    node = _packed(idx, 10, epochs=2)
    node.reset(pickle.loads(pickle.dumps(state)))
    return node


def test_a_buffer_whose_states_are_never_taken_keeps_bounded_memory(index, monkeypatch) -> None:
    """Iterated without taking states (a plain torchdata Loader takes none per step), the buffer
    still lets go of the provenance tables of the items it handed out: the journal is built into
    a new base as it grows, not only when a state is taken."""
    import gc
    import weakref

    from torchdata_ext.nodes import shuffle_state

    monkeypatch.setattr(shuffle_state, "JOURNAL_SLACK", 3)
    idx, _ = index
    node = make(idx, 10, epochs=None)
    node.reset()
    tables = []
    for _ in range(3000):
        tables.append(weakref.ref(node._provenance(next(node))))
    gc.collect()
    alive = sum(t() is not None for t in tables)
    assert alive <= 4 * (2 * 10 + 3), alive  # a few journals' worth, not all 3,000
    # and the states taken afterwards are still exact
    state = node.state_dict()
    fresh = make(idx, 10, epochs=None)
    fresh.reset(pickle.loads(pickle.dumps(state)))
    assert [item_key(x) for x in run(fresh, 30)] == [item_key(x) for x in run(node, 30)]


def test_a_state_of_other_block_sizes_restores(index) -> None:
    """Blocks of another size than the buffer's own (a state written by other code): the
    restore journals every slot instead of taking the blocks as its base; the stream and the
    states after it are the same."""
    idx, _ = index
    node = make(idx, 10)
    for _ in range(12):
        next(node)
    state = pickle.loads(pickle.dumps(node.state_dict()))
    counts, rows = buffered_provenance(state)
    odd = {k: v for k, v in state.items() if k != "prov_groups"}
    odd["prov_blocks"] = [(counts[:3], rows[:3]), (counts[3:], rows[3:])]
    a, b = make(idx, 10), make(idx, 10)
    a.reset(state)
    b.reset(odd)
    for _ in range(5):
        assert item_key(next(a)) == item_key(next(b))
        assert [x.tolist() for x in buffered_provenance(b.state_dict())] == [
            x.tolist() for x in buffered_provenance(a.state_dict())
        ]


def test_the_share_warning_fires_for_text_data_too(tmp_path, caplog) -> None:
    """Text datasets count no tokens: the share is estimated from the files' sizes (one token
    per byte with the byte tokenizer)."""
    from torchdata_ext import PipelineConfig, build_pipeline
    from torchdata_ext.testing import write_jsonl

    write_jsonl(str(tmp_path / "web" / "a.jsonl"), ["x" * 40] * 64)
    size = (tmp_path / "web" / "a.jsonl").stat().st_size
    cfg = PipelineConfig(
        data_path=str(tmp_path), datasets="web", file_type="jsonl", col_name="text",
        tokenizer="byte", seq_length=16, logical_shards=8, shuffle_buffer=100, batch_size=2,
    )  # fmt: skip
    caplog.set_level("WARNING", logger="torchdata_ext.nodes.shuffle")
    node = build_pipeline(cfg, World(rank=1, world_size=2, worker_id=0, num_workers=2))
    node.reset()
    next(node)
    share = size // (4 * 16)  # ~56 sequences of 16 for each of 4 workers
    assert share < 100
    assert f"holds 100 items but this worker's share of the data is only ~{share}:" in caplog.text
