"""Tokenize: same ids as the tokenizer itself, BOS/EOS rules, provenance, exact resume, threads."""

from __future__ import annotations

import gc
import pickle
import threading
import time

import numpy as np
import pytest
from harness import check_loader_restore, check_restore_at_every_step, item_key, run
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.document import DocumentBlock
from torchdata_ext.nodes.tokenize import Tokenize, ensure_bos_eos
from torchdata_ext.testing import write_arrow_batches, write_jsonl
from torchdata_ext.tokenizers.load import ByteTokenizer, as_encoder

WORDS = [
    "the", "data", "loader", "packs", "tokens", "für", "naïve", "日本語", "données",
    "модель", "🙂", "shard", "epoch", "résumé", "x", "tokenizer", "!", "\n",
]  # fmt: skip


def sentences(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 30)))) for _ in range(n)]


def train_bpe(post_process: bool = False) -> Tokenizer:
    """A byte-level BPE tokenizer trained on generated text (no download)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sentences(400, 0), trainer)
    if post_process:  # the tokenizer adds <s> ... </s> itself
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)]
        )
    return tok


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_bpe()


@pytest.fixture(scope="module")
def texts_dir(tmp_path_factory):
    """3 JSONL files (one gzipped), 90 texts incl. an empty one (the reader skips it)."""
    root = tmp_path_factory.mktemp("text") / "web"
    root.mkdir()
    texts = sentences(90, 1)
    texts[7] = ""
    write_jsonl(str(root / "a.jsonl"), texts[:30])
    write_jsonl(str(root / "b.jsonl.gz"), texts[30:70])
    write_jsonl(str(root / "c.jsonl"), texts[70:])
    index = DatasetIndex.build(str(root))
    by_key = {}
    start = 0
    for f, n in enumerate(index.doc_counts):
        for d in range(int(n)):
            by_key[(f, d)] = texts[start + d]
        start += int(n)
    return index, by_key


def reader(index, **kw) -> ShardReader:
    kw.setdefault("block_docs", 8)
    return ShardReader(index, 6, world=World(), seed=3, **kw)


def expected_ids(ids: list[int], bos: int | None, eos: int | None) -> list[int]:
    """ensure_bos_eos, one document at a time, in plain Python (the reference)."""
    out = list(ids)
    if bos is not None and bos == eos:
        if not out or (out[0] != bos and out[-1] != eos):
            out.append(eos)
        return out
    if bos is not None and (not out or out[0] != bos):
        out.insert(0, bos)
    if eos is not None and (not out or out[-1] != eos):
        out.append(eos)
    return out


# -- tokenizers --------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(), max_size=6), st.sampled_from([0, 3]))
def test_byte_tokenizer_round_trip(texts, offset) -> None:
    tok = ByteTokenizer(offset)
    ids = tok.encode_batch(texts)
    assert len(ids) == len(texts)
    for text, arr in zip(texts, ids):
        assert arr.dtype == np.int32 and arr.ndim == 1
        assert arr.tolist() == [b + offset for b in text.encode("utf-8")]
        assert tok.decode(arr) == text
        assert tok.decode(arr.tolist()) == text
    assert as_encoder(tok) is tok


def test_byte_tokenizer_specials() -> None:
    tok = ByteTokenizer(offset=4, bos_token=1, eos_token=2)
    assert (tok.bos_token, tok.eos_token, tok.vocab_size) == (1, 2, 260)
    # "byte" means b -> b + 1 everywhere (DEFAULT_BYTE_OFFSET): id 0 is free for EOS/pad
    assert ByteTokenizer().bos_token is None and ByteTokenizer().vocab_size == 257
    assert ByteTokenizer(0).vocab_size == 256
    assert ByteTokenizer(eos_token=300).vocab_size == 301
    assert tok.decode([1, 4 + 104, 4 + 105, 2]) == "hi"  # specials are dropped
    assert tok.decode([4 + 0xC3]) == "\ufffd"  # a cut UTF-8 sequence
    with pytest.raises(ValueError, match="bos_token=10 collides with the byte ids 1..256"):
        ByteTokenizer(bos_token=10)
    with pytest.raises(ValueError, match="offset=-1"):
        ByteTokenizer(-1)


def test_as_encoder_adapts_tokenizers_and_transformers_style(bpe) -> None:
    texts = sentences(20, 5) + [""]
    direct = [bpe.encode(t).ids for t in texts]
    enc = as_encoder(bpe)
    assert [a.tolist() for a in enc.encode_batch(texts)] == direct

    class TransformersLike:  # duck-typed PreTrainedTokenizerFast: callable -> input_ids
        def __call__(self, batch):
            return {"input_ids": [bpe.encode(t).ids for t in batch], "attention_mask": []}

    got = as_encoder(TransformersLike()).encode_batch(texts)
    assert [a.tolist() for a in got] == direct
    assert all(a.dtype.kind == "i" for a in got)
    with pytest.raises(TypeError, match="is not a tokenizer"):
        as_encoder(42)

    class NoIds:
        def __call__(self, batch):
            return {"ids": []}

    with pytest.raises(TypeError, match="no 'input_ids'"):
        as_encoder(NoIds()).encode_batch(["a"])


# -- ensure_bos_eos ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "doc,bos,eos,want",
    [
        ([5, 6], 1, 2, [1, 5, 6, 2]),
        ([1, 5, 6], 1, 2, [1, 5, 6, 2]),
        ([5, 6, 2], 1, 2, [1, 5, 6, 2]),
        ([1, 5, 2], 1, 2, [1, 5, 2]),
        ([1], 1, 2, [1, 2]),
        ([2], 1, 2, [1, 2]),
        ([], 1, 2, [1, 2]),
        ([5], None, 2, [5, 2]),
        ([5, 2], None, 2, [5, 2]),
        ([], None, 2, [2]),
        ([5], 1, None, [1, 5]),
        ([], 1, None, [1]),
        ([5], None, None, [5]),
        ([], None, None, []),
        # bos == eos: a token at either end is not doubled, otherwise one EOS
        ([5, 6], 0, 0, [5, 6, 0]),
        ([0, 5, 6], 0, 0, [0, 5, 6]),
        ([5, 6, 0], 0, 0, [5, 6, 0]),
        ([0], 0, 0, [0]),
        ([], 0, 0, [0]),
        ([5, 0, 6], 0, 0, [5, 0, 6, 0]),
    ],
)
def test_ensure_bos_eos_cases(doc, bos, eos, want) -> None:
    tokens, offsets = ensure_bos_eos(np.array(doc, np.int64), np.array([0, len(doc)]), bos, eos)
    assert tokens.tolist() == want and offsets.tolist() == [0, len(want)]
    assert expected_ids(doc, bos, eos) == want  # the reference agrees


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), max_size=5), max_size=8),
    st.sampled_from([None, 0, 1]),
    st.sampled_from([None, 0, 2]),
    st.sampled_from([np.int32, np.uint16, np.int64]),
)
def test_ensure_bos_eos_on_a_block_equals_per_document_rule(docs, bos, eos, dtype) -> None:
    block = DocumentBlock.from_pieces(
        "d",
        [np.array(d, np.int64) for d in docs],
        [0] * len(docs),
        range(len(docs)),
        [0] * len(docs),
        [True] * len(docs),
        dtype=np.int64,
    )
    tokens, offsets = ensure_bos_eos(block.tokens, block.offsets, bos, eos, dtype)
    assert tokens.dtype == dtype
    got = [tokens[offsets[i] : offsets[i + 1]].tolist() for i in range(len(docs))]
    assert got == [expected_ids(d, bos, eos) for d in docs]


# -- the node ------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_threads,prefetch", [(2, 3), (0, 1), (1, 1)])
def test_same_ids_as_the_tokenizer_through_a_reader(texts_dir, bpe, num_threads, prefetch) -> None:
    index, by_key = texts_dir
    node = Tokenize(
        reader(index, epochs=1),
        bpe,
        bos_token=0,
        eos_token=1,
        num_threads=num_threads,
        prefetch=prefetch,
    )
    blocks = run(node)
    seen = []
    for block in blocks:
        assert block.texts is None and block.tokens.dtype == np.int32
        assert block.dataset == "web" and block.shard >= 0 and block.epoch == 0
        assert not block.start.any() and block.last.all()
        for d in block:
            want = expected_ids(bpe.encode(by_key[(d.file, d.doc)]).ids, 0, 1)
            assert d.data.tolist() == want
            seen.append((d.file, d.doc))
    assert sorted(seen) == sorted(k for k, t in by_key.items() if t)  # every text once
    # the provenance columns are the reader's
    ref = run(reader(index, epochs=1))
    assert [(b.file.tolist(), b.doc.tolist(), b.shard) for b in blocks] == [
        (b.file.tolist(), b.doc.tolist(), b.shard) for b in ref
    ]


def test_tokenizer_specials_are_not_doubled(texts_dir) -> None:
    index, by_key = texts_dir
    tok = train_bpe(post_process=True)
    for block in run(Tokenize(reader(index, epochs=1), tok, bos_token=0, eos_token=1)):
        for d in block:
            direct = tok.encode(by_key[(d.file, d.doc)]).ids
            assert direct[0] == 0 and direct[-1] == 1
            assert d.data.tolist() == direct


def test_byte_tokenizer_through_the_node(texts_dir) -> None:
    index, by_key = texts_dir
    tok = ByteTokenizer(offset=2, bos_token=0, eos_token=1)
    node = Tokenize(reader(index, epochs=1), tok, bos_token=0, eos_token=1, dtype=np.uint16)
    for block in run(node):
        assert block.tokens.dtype == np.uint16
        for d in block:
            assert d.data[0] == 0 and d.data[-1] == 1
            assert tok.decode(d.data) == by_key[(d.file, d.doc)]


def test_token_blocks_pass_through(tmp_path) -> None:
    root = tmp_path / "tok"
    root.mkdir()
    rng = np.random.default_rng(0)
    write_arrow_batches(str(root / "a.arrow"), [rng.integers(0, 99, 5) for _ in range(20)])
    index = DatasetIndex.build(str(root))
    got = run(Tokenize(reader(index, epochs=2), ByteTokenizer(), bos_token=0, eos_token=1))
    assert [item_key(b) for b in got] == [item_key(b) for b in run(reader(index, epochs=2))]


@pytest.mark.parametrize("num_threads,prefetch", [(2, 3), (0, 1)])
def test_restore_at_every_step(texts_dir, bpe, num_threads, prefetch) -> None:
    index, _ = texts_dir
    items = check_restore_at_every_step(
        lambda: Tokenize(
            reader(index, epochs=2, block_docs=5),
            bpe,
            bos_token=0,
            eos_token=1,
            num_threads=num_threads,
            prefetch=prefetch,
        )
    )
    assert {b.epoch for b in items} == {0, 1} and len(items) >= 36


def test_restore_endless_reader_and_through_loader(texts_dir, bpe) -> None:
    index, _ = texts_dir
    make = lambda: Tokenize(reader(index, block_docs=7), bpe, eos_token=1, prefetch=4)  # noqa: E731
    items = check_restore_at_every_step(make, max_steps=40, steps=[0, 1, 2, 13, 14, 15, 30, 39])
    assert {b.epoch for b in items} >= {0, 1, 2}
    check_loader_restore(make, steps=30, at=[0, 5, 29])


def test_skip_next_encodes_only_what_is_left_and_starts_at_once(texts_dir, bpe) -> None:
    """After a restore an interleave replays the block it stopped in and drops the pieces it
    had delivered (``skip_next``): those are not encoded again (they come out empty), the
    rest and the blocks after are the uninterrupted stream's, and the encoding is under way
    before the block is asked for (so several datasets' blocks encode side by side)."""
    index, _ = texts_dir
    make = lambda: Tokenize(reader(index, epochs=1, block_docs=4), bpe, eos_token=1, prefetch=2)  # noqa: E731
    ref = run(make(), 12)
    node = make()
    node.reset()
    for _ in range(5):
        next(node)
    state = pickle.loads(pickle.dumps(node.state_dict()))
    node.close()
    for threads in (2, 0):
        again = Tokenize(
            reader(index, epochs=1, block_docs=4), bpe, eos_token=1, prefetch=2,
            num_threads=threads,
        )  # fmt: skip
        again.reset(state)
        again.skip_next(3)
        assert len(again._pending) == (2 if threads else 0)  # submitted before next()
        first = next(again)
        want = ref[5]
        assert [len(d.data) for d in list(first)[:3]] == [0, 0, 0]
        assert [d.data.tolist() for d in list(first)[3:]] == [
            d.data.tolist() for d in list(want)[3:]
        ]
        assert (first.file == want.file).all() and (first.doc == want.doc).all()
        rest = [next(again) for _ in range(6)]
        assert [item_key(b) for b in rest] == [item_key(b) for b in ref[6:]]
        again.close()
    fresh = make()
    fresh.reset()  # a fresh start reads nothing before it is asked (the first batch's source
    assert not fresh._pending  # may be another dataset)


def test_pickled_mid_stream_node_continues(texts_dir, bpe) -> None:
    index, _ = texts_dir
    ref = run(Tokenize(reader(index, epochs=1, block_docs=4), bpe, eos_token=1), 12)
    node = Tokenize(reader(index, epochs=1, block_docs=4), bpe, eos_token=1, prefetch=3)
    first = run(node, 5)
    copy = pickle.loads(pickle.dumps(node))  # blocks in flight are read again
    rest = run(copy, 7)
    assert [item_key(b) for b in first + rest] == [item_key(b) for b in ref]
    node.close()


def test_fetch_document_equals_delivered(texts_dir, bpe) -> None:
    index, _ = texts_dir
    node = Tokenize(reader(index, epochs=1), bpe, bos_token=0, eos_token=1)
    n = 0
    for block in run(node):
        for d in block:
            fetched = node.fetch_document(d.dataset, d.file, d.doc)
            assert fetched.dtype == d.data.dtype and np.array_equal(fetched, d.data)
            n += 1
    assert n == 89
    with pytest.raises(KeyError, match="not 'other'"):
        node.fetch_document("other", 0, 0)


def test_chunked_text_is_refused(texts_dir, bpe) -> None:
    index, _ = texts_dir
    for num_threads in (0, 2):
        node = Tokenize(reader(index, max_chunksize=5), bpe, num_threads=num_threads)
        with pytest.raises(ValueError, match="do not set max_chunksize on a text reader"):
            run(node)
        node.close()


def test_ids_that_do_not_fit_the_dtype_are_refused(texts_dir) -> None:
    index, _ = texts_dir
    node = Tokenize(reader(index), ByteTokenizer(offset=200), dtype=np.uint8, num_threads=0)
    with pytest.raises(ValueError, match="do not fit dtype=dtype\\('uint8'\\)"):
        run(node, 1)


def test_bad_arguments_name_the_argument(texts_dir, bpe) -> None:
    index, _ = texts_dir
    with pytest.raises(ValueError, match="prefetch=0 must be >= 1"):
        Tokenize(reader(index), bpe, prefetch=0)
    with pytest.raises(ValueError, match="num_threads=-1 must be >= 0"):
        Tokenize(reader(index), bpe, num_threads=-1)
    with pytest.raises(TypeError, match="bos_token='<s>'"):
        Tokenize(reader(index), bpe, bos_token="<s>")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eos_token=70000 must be >= 0 and fit"):
        Tokenize(reader(index), bpe, eos_token=70000, dtype=np.uint16)
    with pytest.raises(TypeError, match="dtype="):
        Tokenize(reader(index), bpe, dtype=np.float32)
    with pytest.raises(TypeError, match="BaseNode"):
        Tokenize([1, 2], bpe)  # type: ignore[arg-type]


def _pool_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("torchdata_ext-tokenize")}


def _wait_dead(threads: set[threading.Thread]) -> bool:
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not any(t.is_alive() for t in threads)


def test_no_threads_leak(texts_dir, bpe) -> None:
    index, _ = texts_dir
    before = _pool_threads()
    node = Tokenize(reader(index), bpe, num_threads=2, prefetch=4)
    run(node, 5)
    mine = _pool_threads() - before
    assert 1 <= len(mine) <= 2
    node.reset()  # in-flight blocks are dropped, the pool is kept
    run(node, 3)
    assert _pool_threads() - before == mine
    node.close()  # joins the threads
    assert not any(t.is_alive() for t in mine)
    run(node, 2)  # usable again after close, with a new pool
    mine = _pool_threads() - before
    assert mine
    del node
    gc.collect()
    assert _wait_dead(mine)  # garbage collection shuts the pool down
