"""ShardReader: exactly once per epoch, random-walk order, exact resume, clear errors."""

from __future__ import annotations

import collections
import logging
import pickle

import numpy as np
import pytest
from harness import check_loader_restore, check_restore_at_every_step, item_key, run

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.handlers import DataFileError
from torchdata_ext.state.reader_state import reader_cursors
from torchdata_ext.testing import write_arrow_batches, write_jsonl


def make_docs(n: int, seed: int, lo: int = 1, hi: int = 40, base: int = 0) -> list[np.ndarray]:
    """Documents whose first token is a unique id, so content identifies them."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        length = int(rng.integers(lo, hi))
        body = rng.integers(10, 50_000, size=length - 1, dtype=np.uint32)
        docs.append(np.concatenate([np.array([base + i + 1_000_000], np.uint32), body]))
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """3 Arrow files (Bamba layout), 1,000 documents."""
    root = tmp_path_factory.mktemp("corpus") / "web"
    root.mkdir()
    docs = make_docs(1000, 0)
    cuts = [0, 300, 750, 1000]
    for f in range(3):
        write_arrow_batches(str(root / f"part_{f}.arrow"), docs[cuts[f] : cuts[f + 1]])
    return str(root), docs


def doc_keys(blocks) -> list[tuple]:
    return [tuple(d.data.tolist()) for b in blocks for d in b]


def all_docs(index, n_shards, world, **kw):
    return run(ShardReader(index, n_shards, world=world, epochs=1, **kw))


@pytest.mark.parametrize(
    "ranks,workers", [(1, 1), (1, 2), (2, 1), (5, 1), (1, 5)], ids=lambda v: str(v)
)
def test_one_epoch_delivers_each_document_exactly_once(corpus, ranks, workers) -> None:
    root, docs = corpus
    index = DatasetIndex.build(root)
    assert index.total_docs == 1000 and len(index.files) == 3
    got: list[tuple] = []
    for r in range(ranks):
        for w in range(workers):
            got += doc_keys(all_docs(index, 64, World(r, ranks, w, workers), block_docs=7))
    assert collections.Counter(got) == collections.Counter(tuple(d.tolist()) for d in docs)


def test_provenance_points_at_the_source_document(corpus) -> None:
    root, docs = corpus
    index = DatasetIndex.build(root)
    offsets = np.concatenate([[0], np.cumsum(index.doc_counts)])
    for block in all_docs(index, 10, World(), block_docs=16):
        assert len(set(block.file.tolist())) == 1  # one file per block
        for d in block:
            assert np.array_equal(d.data, docs[offsets[d.file] + d.doc])
            assert d.dataset == "web" and d.start == 0 and d.last
        assert block.tokens.dtype == np.int32


def test_order_is_shuffled_and_changes_per_epoch(corpus) -> None:
    root, docs = corpus
    index = DatasetIndex.build(root)
    reader = ShardReader(index, 64, world=World(), block_docs=50, epochs=2)
    blocks = run(reader)
    first = [d.data[0] - 1_000_000 for b in blocks if b.epoch == 0 for d in b]
    second = [d.data[0] - 1_000_000 for b in blocks if b.epoch == 1 for d in b]
    assert sorted(first) == sorted(second) == list(range(1000))
    assert first != second
    assert abs(np.corrcoef(first, np.arange(1000))[0, 1]) < 0.2  # not file order
    # shards are read one at a time: each shard's blocks are contiguous within an epoch
    seq = [(b.epoch, b.shard) for b in blocks]
    runs = [k for i, k in enumerate(seq) if i == 0 or seq[i - 1] != k]
    assert len(runs) == len(set(runs)) == 128


def test_same_seed_same_stream_other_seed_other_stream(corpus) -> None:
    index = DatasetIndex.build(corpus[0])
    a = doc_keys(all_docs(index, 16, World(), seed=1))
    b = doc_keys(all_docs(index, 16, World(), seed=1))
    c = doc_keys(all_docs(index, 16, World(), seed=2))
    assert a == b and a != c and sorted(a) == sorted(c)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small") / "books"
    root.mkdir()
    docs = make_docs(45, 3, lo=1, hi=30)
    # strip-able BOS (1) / EOS (2) on some docs
    docs = [
        np.concatenate([[1], d, [2, 2]]).astype(np.uint32) if i % 3 == 0 else d
        for i, d in enumerate(docs)
    ]
    write_arrow_batches(str(root / "a.arrow"), docs[:20])
    write_arrow_batches(str(root / "b.arrow"), docs[20:])
    return str(root), docs


@pytest.mark.parametrize(
    "kw",
    [
        dict(block_docs=1),
        dict(block_docs=4),
        dict(block_docs=3, max_chunksize=5, strip_tokens=(1, 2), min_length=3),
    ],
    ids=["one_doc_blocks", "four_doc_blocks", "chunks_strip_minlen"],
)
def test_restore_at_every_step_across_epochs(small, kw) -> None:
    index = DatasetIndex.build(small[0])
    for world in (World(), World(0, 1, 1, 2)):
        items = check_restore_at_every_step(
            lambda world=world: ShardReader(index, 6, world=world, epochs=3, seed=5, **kw)
        )
        assert {b.epoch for b in items} == {0, 1, 2}


def test_restore_through_loader(small) -> None:
    index = DatasetIndex.build(small[0])
    check_loader_restore(
        lambda: ShardReader(index, 5, world=World(), block_docs=2, max_chunksize=4),
        steps=80,
        at=[0, 1, 7, 30, 79],
    )


def test_endless_by_default(small) -> None:
    index = DatasetIndex.build(small[0])
    reader = ShardReader(index, 5, world=World(), block_docs=45)
    blocks = run(reader, 60)
    assert len(blocks) == 60 and max(b.epoch for b in blocks) >= 5


def test_chunks_strip_and_min_length(small) -> None:
    root, docs = small
    index = DatasetIndex.build(root)
    blocks = all_docs(
        index, 3, World(), block_docs=4, max_chunksize=4, strip_tokens=(1, 2), min_length=3
    )
    pieces: dict[tuple[int, int], list] = collections.defaultdict(list)
    for b in blocks:
        assert (b.lengths <= 4).all()
        for d in b:
            pieces[(d.file, d.doc)].append(d)
    expected = {}
    for i, d in enumerate(docs):
        s = d
        while len(s) and s[0] in (1, 2):
            s = s[1:]
        while len(s) and s[-1] in (1, 2):
            s = s[:-1]
        if len(s) >= 3:
            expected[(0, i) if i < 20 else (1, i - 20)] = s
    assert set(pieces) == set(expected)
    for key, ps in pieces.items():
        assert [p.start for p in ps] == list(range(0, len(expected[key]), 4))
        assert [p.last for p in ps] == [False] * (len(ps) - 1) + [True]
        assert np.array_equal(np.concatenate([p.data for p in ps]), expected[key])


def test_text_documents_come_out_as_strings(tmp_path) -> None:
    texts = [f"document number {i} " + "x" * i for i in range(30)]
    write_jsonl(str(tmp_path / "t.jsonl"), texts)
    index = DatasetIndex.build(str(tmp_path / "t.jsonl"))
    got = [d.data for b in all_docs(index, 4, World(), block_docs=5) for d in b]
    assert sorted(got) == sorted(texts)
    chunked = all_docs(index, 4, World(), max_chunksize=10)
    assert all(len(d.data) <= 10 for b in chunked for d in b)


# -- errors and refusals ------------------------------------------------------------------------
def test_bad_arguments_name_the_argument(small) -> None:
    index = DatasetIndex.build(small[0])
    with pytest.raises(ValueError, match="n_logical_shards=46 must be <= the number of documents"):
        ShardReader(index, 46)
    with pytest.raises(ValueError, match="n_logical_shards=3 must be >= .*global workers"):
        ShardReader(index, 3, world=World(0, 2, 0, 2)).reset()
    with pytest.raises(ValueError, match="block_docs=0 must be >= 1"):
        ShardReader(index, 3, block_docs=0)
    with pytest.raises(TypeError, match="epochs=1.5 must be an integer"):
        ShardReader(index, 3, epochs=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_length=-1"):
        ShardReader(index, 3, min_length=-1)
    with pytest.raises(ValueError, match="on_error='ignore'"):
        ShardReader(index, 3, on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="DatasetIndex.build"):
        ShardReader(small[0], 3)  # type: ignore[arg-type]


def test_restore_refuses_other_seed_shards_or_data(small, tmp_path) -> None:
    index = DatasetIndex.build(small[0])
    reader = ShardReader(index, 6, world=World(), seed=1)
    next(reader)
    state = reader.state_dict()
    with pytest.raises(ValueError, match="seed differs"):
        ShardReader(index, 6, world=World(), seed=2).reset(state)
    with pytest.raises(ValueError, match="n_logical_shards differs"):
        ShardReader(index, 7, world=World(), seed=1).reset(state)
    other = tmp_path / "books"
    other.mkdir()
    write_arrow_batches(str(other / "a.arrow"), small[1][:21])
    with pytest.raises(ValueError, match="dataset's files or document counts differ"):
        ShardReader(DatasetIndex.build(str(other)), 6, world=World(), seed=1).reset(state)
    # a rank that owns a shard missing from the state says what to pass
    partial = ShardReader(index, 6, world=World(0, 1, 0, 2), seed=1)
    with pytest.raises(ValueError, match="no cursor for logical shard 3"):
        ShardReader(index, 6, world=World(0, 1, 1, 2), seed=1).reset(partial.state_dict())


def test_corrupt_file_raises_by_default_and_is_skipped_on_request(tmp_path, caplog) -> None:
    root = tmp_path / "d"
    root.mkdir()
    docs = make_docs(60, 9)
    for f in range(3):
        write_arrow_batches(str(root / f"p{f}.arrow"), docs[f * 20 : (f + 1) * 20])
    index = DatasetIndex.build(str(root))  # counts taken while the files are good
    bad = root / "p1.arrow"
    bad.write_bytes(bad.read_bytes()[:-200])
    with pytest.raises(DataFileError, match="p1.arrow"):
        run(ShardReader(index, 6, world=World(), epochs=1))

    def make():
        return ShardReader(index, 6, world=World(), epochs=2, on_error="skip", block_docs=5)

    with caplog.at_level(logging.WARNING):
        reader = make()
        blocks = run(reader)
    assert "p1.arrow" in caplog.text
    got = collections.Counter(doc_keys(blocks))
    want = collections.Counter(tuple(d.tolist()) for d in (docs[:20] + docs[40:]) * 2)
    assert got == want
    assert reader.skipped == 40  # 20 documents, both epochs
    state = reader.state_dict()
    extras = reader_cursors(state).extras.values()
    assert sum(len(e.get("skipped_files", [])) for e in extras) >= 1
    # resume mid-run: skips the same things without new warnings, and restores exactly
    items = check_restore_at_every_step(make)
    assert [item_key(x) for x in items] == [item_key(x) for x in blocks]


@pytest.mark.parametrize("where", ["open", "get"])
@pytest.mark.parametrize("bug", [TypeError, AttributeError])
def test_a_bug_in_a_handler_is_never_a_file_to_skip(tmp_path, monkeypatch, caplog, where, bug):
    """on_error="skip" skips bad files (a truncated one is still skipped), but a handler's
    programming error, opening or reading, propagates instead of becoming a skipped file."""
    from torchdata_ext.handlers.arrow import ArrowHandler

    root = tmp_path / "d"
    root.mkdir()
    docs = make_docs(60, 9)
    for f in range(3):
        write_arrow_batches(str(root / f"p{f}.arrow"), docs[f * 20 : (f + 1) * 20])
    index = DatasetIndex.build(str(root))
    bad = root / "p1.arrow"
    bad.write_bytes(bad.read_bytes()[:-200])  # truncated: skipped

    def make():
        return ShardReader(index, 6, world=World(), epochs=1, on_error="skip", block_docs=5)

    with caplog.at_level(logging.WARNING):
        reader = make()
        got = collections.Counter(doc_keys(run(reader)))
    assert "skipping unreadable file" in caplog.text and "p1.arrow" in caplog.text
    assert got == collections.Counter(tuple(d.tolist()) for d in docs[:20] + docs[40:])
    assert reader.skipped == 20

    def buggy(real):
        def call(self, reader_or_url, *args):
            url = reader_or_url if isinstance(reader_or_url, str) else reader_or_url.url
            if url.endswith("p2.arrow"):
                raise bug("a bug in the handler")
            return real(self, reader_or_url, *args)

        return call

    names = ("open",) if where == "open" else ("get", "get_many")
    for name in names:
        monkeypatch.setattr(ArrowHandler, name, buggy(getattr(ArrowHandler, name)))
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(bug, match="a bug in the handler"):
        run(make())
    assert "p2.arrow" not in caplog.text  # never logged as an unreadable file or document


def test_states_are_small_and_plain(corpus) -> None:
    index = DatasetIndex.build(corpus[0])
    reader = ShardReader(index, 1000, world=World(), block_docs=3)
    for _ in range(50):
        next(reader)
    state = reader.state_dict()
    assert len(reader_cursors(state)) == 1000
    blob = pickle.dumps(state)
    # column arrays: ~7 bytes a shard (format 1's dict per shard was ~100), no token buffers
    assert len(blob) < 12_000
    assert _plain(state)


def _plain(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_plain(v) for v in x)
    if isinstance(x, np.ndarray):
        return x.dtype.kind == "i" and not x.flags.writeable  # cursor columns, read-only
    return isinstance(x, (int, float, str, bool)) or x is None


@pytest.mark.parametrize(
    "before,after",
    [((2, 2), (1, 1)), ((2, 2), (3, 1)), ((1, 3), (2, 2)), ((3, 1), (1, 5)), ((1, 1), (4, 2))],
    ids=str,
)
def test_rescale_delivers_exactly_what_was_left(corpus, before, after) -> None:
    """Save at R x W mid-epoch, merge, restore at R' x W': nothing repeated, nothing lost."""
    from torchdata_ext.nodes import merge_reader_states

    index = DatasetIndex.build(corpus[0])
    n_shards = 40
    seen: list[tuple] = []
    states = []
    rng = np.random.default_rng(sum(before) * 7 + sum(after))
    r0, w0 = before
    for r in range(r0):
        for w in range(w0):
            reader = ShardReader(index, n_shards, world=World(r, r0, w, w0), epochs=1, block_docs=3)
            seen += doc_keys(run(reader, int(rng.integers(0, 40))))
            states.append(pickle.loads(pickle.dumps(reader.state_dict())))
    merged = merge_reader_states(states)
    r1, w1 = after
    for r in range(r1):
        for w in range(w1):
            reader = ShardReader(index, n_shards, world=World(r, r1, w, w1), epochs=1, block_docs=5)
            reader.reset(merged)
            seen += doc_keys(run(reader))
    assert collections.Counter(seen) == collections.Counter(tuple(d.tolist()) for d in corpus[1])


def test_merge_refuses_incomplete_or_mixed_states(small) -> None:
    from torchdata_ext.nodes import merge_reader_states

    index = DatasetIndex.build(small[0])
    a = ShardReader(index, 6, world=World(0, 1, 0, 2))
    b = ShardReader(index, 6, world=World(0, 1, 1, 2))
    with pytest.raises(ValueError, match="cover 3 of 6 logical shards"):
        merge_reader_states([a.state_dict()])
    with pytest.raises(ValueError, match="appears in two states"):
        merge_reader_states([a.state_dict(), a.state_dict(), b.state_dict()])
    c = ShardReader(index, 6, world=World(0, 1, 1, 2), seed=9)
    with pytest.raises(ValueError, match="seed=9"):
        merge_reader_states([a.state_dict(), c.state_dict()])


def test_fetch_document_rebuilds_any_piece_from_provenance(small) -> None:
    index = DatasetIndex.build(small[0])
    reader = ShardReader(
        index, 4, world=World(), block_docs=3, max_chunksize=4, strip_tokens=(1, 2)
    )
    for block in run(reader, 30):
        for i, d in enumerate(block):
            whole = reader.fetch_document("books", d.file, d.doc)
            assert np.array_equal(whole[d.start : d.start + len(d.data)], d.data)
            assert d.last == (d.start + len(d.data) == len(whole))
            sub = block.select(i, i + 1)
            assert np.array_equal(sub.tokens, d.data) and sub.doc[0] == d.doc
    with pytest.raises(KeyError, match="not 'web'"):
        reader.fetch_document("web", 0, 0)


@pytest.mark.parametrize("min_length", [1, 3])
@pytest.mark.parametrize("block_docs", [1, 5, 64])
def test_strip_tokens_in_whole_document_blocks(tmp_path, min_length, block_docs) -> None:
    """The vectorised whole-document path strips runs of strip tokens at both ends exactly as
    the per-document rule does (all-strip documents become empty and are dropped), and
    ``fetch_document`` agrees."""
    from torchdata_ext.nodes.reader import _strip

    rng = np.random.default_rng(11)
    docs = []
    for _ in range(120):
        core = rng.integers(3, 50, int(rng.integers(0, 8)))
        head = rng.choice([0, 7], int(rng.integers(0, 3)))
        tail = rng.choice([0, 7], int(rng.integers(0, 4)))
        docs.append(np.concatenate([head, core, tail]).astype(np.uint32))
    docs.append(np.array([0, 7, 0], np.uint32))  # all strip tokens
    write_arrow_batches(str(tmp_path / "a.arrow"), docs[:70])
    write_arrow_batches(str(tmp_path / "b.arrow"), docs[70:])
    index = DatasetIndex.build(str(tmp_path))
    reader = ShardReader(
        index, 3, world=World(), epochs=1, block_docs=block_docs, strip_tokens=(0, 7),
        min_length=min_length,
    )  # fmt: skip
    strip = np.array([0, 7])
    want = {}
    for f, part in enumerate((docs[:70], docs[70:])):
        for d, doc in enumerate(part):
            kept = _strip(doc.astype(np.int64), strip)
            if len(kept) >= max(min_length, 1):
                want[(f, d)] = kept.tolist()
    got = {}
    for block in reader:
        for doc in block:
            assert doc.start == 0 and doc.last
            got[(doc.file, doc.doc)] = doc.data.tolist()
    assert got == want
    for (f, d), tokens in list(want.items())[:20]:
        assert np.asarray(reader.fetch_document(index.name, f, d)).tolist() == tokens


def test_empty_documents_are_dropped_with_their_offsets(tmp_path) -> None:
    # an empty document among whole-document blocks: its offset was kept while its file/doc
    # entries were dropped, so the block's pieces and provenance no longer matched
    docs = [np.array([1_000 + i] * (i % 3), np.uint32) for i in range(30)]  # every 3rd empty
    write_arrow_batches(str(tmp_path / "a.arrow"), docs)
    index = DatasetIndex.build(str(tmp_path))
    reader = ShardReader(index, 4, world=World(), epochs=1, block_docs=3, seed=1)
    got = []
    for block in run(reader):
        assert len(block.file) == len(block.doc) == len(block)
        for d in block:
            assert d.data.tolist() == docs[d.doc].tolist()  # provenance names the document
            got.append(d.doc)
    assert sorted(got) == [i for i in range(30) if i % 3]


@pytest.mark.parametrize(
    "file_dtype,out_dtype",
    [(np.uint32, np.int32), (np.int32, np.int32), (np.uint16, np.int32), (np.uint32, np.int64)],
    ids=lambda v: np.dtype(v).name,
)
def test_blocks_hold_the_tokens_cast_to_the_output_dtype(tmp_path, file_dtype, out_dtype) -> None:
    """A block's tokens are its documents cast to the reader's dtype as NumPy's unsafe cast
    does (a uint32 id above 2**31 wraps in int32, as it always has), whatever the file's
    integer width: the same-width path concatenates and reinterprets, the others cast."""
    rng = np.random.default_rng(7)
    top = np.iinfo(file_dtype).max
    docs = []
    for i in range(40):
        d = rng.integers(0, top, size=int(rng.integers(1, 30)), dtype=np.int64, endpoint=True)
        d[0] = top - i  # the widest ids of the type, each document told apart by its first
        docs.append(d.astype(file_dtype))
    root = tmp_path / "web"
    root.mkdir()
    write_arrow_batches(str(root / "part_0.arrow"), docs)
    index = DatasetIndex.build(str(root))
    blocks = all_docs(index, 4, World(), block_docs=16, dtype=out_dtype)
    got = {}
    for block in blocks:
        assert block.tokens.dtype == np.dtype(out_dtype)
        for d in block:
            got[d.doc] = d.data
    assert sorted(got) == list(range(40))
    for k, d in enumerate(docs):
        assert np.array_equal(got[k], d.astype(out_dtype, casting="unsafe")), k


def test_plans_are_made_once_per_process_and_read_only(corpus, monkeypatch) -> None:
    """A reader built again (a restore, a rescale, a torchft re-split) takes its shards'
    plans made before: each (shard, epoch) is planned once in the process, and the restored
    reader delivers the rest of the stream. Another seed is planned anew."""
    import torchdata_ext.nodes.reader as reader_module

    reader_module._shard_plan_of.cache_clear()
    made: list[tuple[int, int]] = []
    real = reader_module.shard_plan
    monkeypatch.setattr(
        reader_module, "shard_plan", lambda *a: made.append((a[2], a[3], a[4])) or real(*a)
    )
    index = DatasetIndex.build(corpus[0])
    reader = ShardReader(index, 8, world=World(), block_docs=20, epochs=2, seed=3)
    reader.reset()
    head = [next(reader) for _ in range(9)]
    state = pickle.loads(pickle.dumps(reader.state_dict()))
    rest = [doc_keys([b]) for b in reader]
    assert sorted(made) == sorted(set(made)) and len(made) == 16  # 8 shards, 2 epochs
    again = ShardReader(index, 8, world=World(), block_docs=20, epochs=2, seed=3)
    again.reset(state)
    assert [doc_keys([b]) for b in again] == rest and len(made) == 16 and len(head) == 9
    plan = again._make_plan(0, 0)
    with pytest.raises(ValueError, match="read-only"):
        plan.starts[0] = 1
    other = ShardReader(index, 8, world=World(), block_docs=20, epochs=1, seed=4)
    assert doc_keys(run(other)) != doc_keys(
        run(ShardReader(index, 8, world=World(), block_docs=20, epochs=1, seed=3))
    )
    assert len(made) == 24 and {s for s, _, _ in made} == {3, 4}
