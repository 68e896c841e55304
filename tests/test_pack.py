"""Pack: every token delivered, exact document boundaries, rebuild from provenance, exact resume."""

from __future__ import annotations

import collections
import pickle
from typing import Any

import numpy as np
import pytest
from harness import check_loader_restore, check_restore_at_every_step, item_key, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchdata.nodes import BaseNode

from torchdata_ext import DatasetIndex, DocumentBlock, ShardReader, World
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.testing import write_arrow_batches, write_jsonl

UNIQUE = 100  # document tokens >= UNIQUE are unique over a test corpus; specials are < 10
BOS, EOS, BOL, EOL, PADT = 1, 2, 3, 4, 5

SPECIALS = [
    {},
    {"bos_token": BOS, "eos_token": EOS},
    {"eos_token": 0},  # Bamba: eos 0, pad 0
    {"bos_token": BOS},
    {"bos_token": EOS, "eos_token": EOS, "bol_token": BOL, "eol_token": EOL, "pad_token": PADT},
    {"bos_token": BOS, "eos_token": EOS, "bol_token": BOL, "pad_token": PADT},
    {"eos_token": EOS, "eol_token": EOL, "pad_token": EOL},  # pad id == eol id
    {"bos_token": BOS, "bol_token": BOS, "eol_token": EOS, "pad_token": BOS},
]


class ListSource(BaseNode[DocumentBlock]):
    """Documents from memory, cut into ``max_chunksize`` pieces, ``block_docs`` pieces a block
    (a block may end in the middle of a document, as the reader's do)."""

    def __init__(self, docs, block_docs=3, max_chunksize=None, names=("web",)):
        super().__init__()
        self.docs = [np.asarray(d, np.int32) for d in docs]
        pieces = []
        for i, d in enumerate(self.docs):
            step = max_chunksize or max(len(d), 1)
            starts = list(range(0, len(d), step)) or [0]
            for s in starts:
                pieces.append((i, s, d[s : s + step], s + step >= len(d)))
        self.blocks = []
        for b, lo in enumerate(range(0, len(pieces), block_docs)):
            chunk = pieces[lo : lo + block_docs]
            name = names[b % len(names)]
            self.blocks.append(
                DocumentBlock.from_pieces(
                    name,
                    [p[2] for p in chunk],
                    [self._file_doc(p[0])[0] for p in chunk],
                    [self._file_doc(p[0])[1] for p in chunk],
                    [p[1] for p in chunk],
                    [p[3] for p in chunk],
                )
            )

    @staticmethod
    def _file_doc(i: int) -> tuple[int, int]:
        return i // 4, i % 4

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.i = 0 if initial_state is None else initial_state["i"]

    def next(self):
        if self.i >= len(self.blocks):
            raise StopIteration
        self.i += 1
        return self.blocks[self.i - 1]

    def get_state(self):
        return {"i": self.i}

    def fetch_document(self, dataset, file, doc):
        return self.docs[file * 4 + doc]


def expected_unit(doc: np.ndarray, kw: dict[str, Any]) -> list[int]:
    """A whole document with the BOS/EOS it should get (reference, per token)."""
    d = [int(t) for t in doc]
    if not d:
        return []
    bos, eos = kw.get("bos_token"), kw.get("eos_token")
    if bos is not None and bos == eos:
        return d if d[0] == eos or d[-1] == eos else [*d, eos]
    head = [bos] if bos is not None and d[0] != bos else []
    tail = [eos] if eos is not None and d[-1] != eos else []
    return head + d + tail


def make_corpus(lengths, marks, kw) -> list[np.ndarray]:
    """Documents of unique tokens; some begin with the BOS id or end with the EOS id."""
    docs, nxt = [], UNIQUE
    bos = kw.get("bos_token", BOS)
    eos = kw.get("eos_token", EOS)
    for n, (m_head, m_tail) in zip(lengths, marks):
        d = np.arange(nxt, nxt + n, dtype=np.int32)
        nxt += n
        if n and m_head:
            d[0] = bos
        if n and m_tail:
            d[-1] = eos
        docs.append(d)
    return docs


def packed_tokens(seq: dict[str, np.ndarray], shift: bool) -> np.ndarray:
    if shift:
        assert np.array_equal(seq["labels"][:-1], seq["input_ids"][1:])
        return np.concatenate([seq["input_ids"], seq["labels"][-1:]])
    return seq["input_ids"]


def check_packed(
    seqs, docs, kw: dict[str, Any], mode: str, seq_len: int, shift: bool, chunked: bool = False
) -> None:
    """Everything the output promises, checked against the input documents (in arrival order;
    ``chunked``: documents came cut into pieces, which are then the packing units)."""
    bol, eol = kw.get("bol_token"), kw.get("eol_token")
    pad_token = kw.get("pad_token", 0)
    P = seq_len + shift
    cap = P - (bol is not None) - (eol is not None)
    units = [expected_unit(d, kw) for d in docs]
    where = {t: (i, j) for i, u in enumerate(units) for j, t in enumerate(u) if t >= UNIQUE}
    stream: list[int] = []
    seq_of_token: dict[int, int] = {}
    concat_doc_ids: list[list[int]] = []  # concat: the stream's document index, per sequence
    prev_run: tuple[int, int, int] | None = None
    for n_seq, seq in enumerate(seqs):
        keys = {"input_ids", "position_ids", "document_ids", "loss_mask", "provenance"}
        assert set(seq) == keys | ({"labels"} if shift else set())
        for k in keys - {"provenance"} | ({"labels"} if shift else set()):
            assert seq[k].shape == (seq_len,), k
        assert seq["input_ids"].dtype == np.int32 and seq["loss_mask"].dtype == bool
        assert seq["position_ids"].dtype == seq["document_ids"].dtype == np.int32
        x = packed_tokens(seq, shift)
        prov = seq["provenance"]
        assert prov.dtype == np.int64 and prov.shape[1] == 5 and (prov[:, 4] > 0).all()
        assert prov[:, 4].sum() == P
        pad = np.repeat(prov[:, 0] == PAD, prov[:, 4])
        line = np.zeros(P, bool)
        if bol is not None:
            assert x[0] == bol and prov[0, 0] == LITERAL
            line[0] = True
        if eol is not None:
            assert x[-1] == eol and prov[-1, 0] == LITERAL
            line[-1] = True
        assert (x[pad] == pad_token).all()
        content = ~pad & ~line
        c_idx = np.flatnonzero(content)
        assert len(c_idx) and np.array_equal(c_idx, np.arange(c_idx[0], c_idx[-1] + 1))
        if pad.any():  # one padding run, after all content, before eol
            p_idx = np.flatnonzero(pad)
            assert np.array_equal(p_idx, np.arange(c_idx[-1] + 1, c_idx[-1] + 1 + len(p_idx)))
            assert mode != "concat" or n_seq == len(seqs) - 1
        want_mask = ~pad if not shift else ~pad[:-1] & ~pad[1:]
        assert np.array_equal(seq["loss_mask"], want_mask[:seq_len])
        doc_ids, pos = seq["document_ids"], seq["position_ids"]
        vis = content[:seq_len]
        assert (doc_ids[~vis] == -1).all() and (doc_ids[vis] >= 0).all()
        if bol is not None:
            assert pos[0] == 0
        if eol is not None and not shift:
            assert pos[-1] == 0
        p_vis = np.flatnonzero(pad[:seq_len])
        assert np.array_equal(pos[p_vis], np.arange(len(p_vis)))
        # document runs: numbered 0, 1, 2 .. in order, positions count from 0 in each
        ids = doc_ids[vis]
        assert len(ids) == 0 or ids[0] == 0 and set(np.diff(ids).tolist()) <= {0, 1}
        vals = x[np.flatnonzero(vis)]
        run_starts = np.flatnonzero(np.diff(ids, prepend=-1))
        for r, lo in enumerate(run_starts.tolist()):
            hi = int(run_starts[r + 1]) if r + 1 < len(run_starts) else len(ids)
            assert np.array_equal(pos[np.flatnonzero(vis)][lo:hi], np.arange(hi - lo))
            toks = vals[lo:hi].tolist()
            known = [o for o, t in enumerate(toks) if t >= UNIQUE]
            if not known:  # only specials (e.g. a lone EOS cut off its document)
                assert all(t < UNIQUE for t in toks)
                prev_run = None
                continue
            d, j = where[toks[known[0]]]
            start = j - known[0]
            assert start >= 0 and units[d][start : start + len(toks)] == toks, (r, toks)
            if prev_run is not None and lo > 0:  # a run does not just continue the previous one
                assert not (prev_run[0] == d and prev_run[2] == start), "split run"
            prev_run = (d, start, start + len(toks))
        prev_run = None
        seq_tokens = x[content].tolist()
        for t in seq_tokens:
            if t >= UNIQUE:
                seq_of_token[t] = n_seq
        stream += seq_tokens
        concat_doc_ids.append(ids.tolist())
    all_units = [t for u in units for t in u]
    if mode == "concat":  # exactly the documents, in order, with their specials
        assert stream == all_units
        # the document ids follow the true document boundaries exactly
        owner = [i for i, u in enumerate(units) for _ in u]
        pos_in_stream = 0
        for n_seq, seq in enumerate(seqs):
            ids = concat_doc_ids[n_seq]
            true = owner[pos_in_stream : pos_in_stream + len(ids)]
            renum = np.unique(true, return_inverse=True)[1] if true else []
            assert list(renum) == ids
            pos_in_stream += int(
                (~np.repeat(seq["provenance"][:, 0] == PAD, seq["provenance"][:, 4])).sum()
                - (bol is not None)
                - (eol is not None)
            )
    else:  # the same documents as a multiset, nothing lost, nothing twice
        assert collections.Counter(stream) == collections.Counter(all_units)
        assert len(stream) == len(all_units)
        for u in units if not chunked else []:  # a unit that fits a sequence is never split
            if 0 < len(u) <= cap and any(t >= UNIQUE for t in u):
                assert len({seq_of_token[t] for t in u if t >= UNIQUE}) == 1
        if mode == "pad":  # arrival order
            firsts = [
                min(seq_of_token[t] for t in u if t >= UNIQUE)
                for u in units
                if max(u, default=0) >= UNIQUE
            ]
            assert firsts == sorted(firsts)


def check_rebuild(pack: Pack, seqs) -> None:
    for seq in seqs:
        again = pack.rebuild(seq["provenance"])
        assert item_key(again) == item_key(seq)


@st.composite
def scenarios(draw):
    kw = dict(draw(st.sampled_from(SPECIALS)))
    mode = draw(st.sampled_from(["concat", "pad", "best_fit"]))
    shift = draw(st.booleans())
    extra = (kw.get("bol_token") is not None) + (kw.get("eol_token") is not None)
    seq_len = draw(st.integers(max(1, 1 + extra - shift), 12))
    n = draw(st.integers(1, 14))
    lengths = draw(
        st.lists(
            st.one_of(st.integers(0, 2), st.integers(1, 6), st.integers(1, 3 * seq_len + 3)),
            min_size=n,
            max_size=n,
        )
    )
    marks = draw(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=n, max_size=n))
    chunk = draw(st.one_of(st.none(), st.integers(1, 7)))
    block_docs = draw(st.integers(1, 5))
    window = draw(st.integers(1, 6))
    return kw, mode, shift, seq_len, lengths, marks, chunk, block_docs, window


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_every_token_delivered_with_exact_boundaries(scenario) -> None:
    kw, mode, shift, seq_len, lengths, marks, chunk, block_docs, window = scenario
    docs = make_corpus(lengths, marks, kw)
    # blocks alternate between two datasets when documents are whole (a block is one dataset)
    names = ("web", "books") if chunk is None else ("web",)
    src = ListSource(docs, block_docs=block_docs, max_chunksize=chunk, names=names)
    pack = Pack(src, seq_len, mode=mode, shift=shift, window=window, **kw)
    seqs = run(pack)
    check_packed(seqs, docs, kw, mode, seq_len, shift, chunked=chunk is not None)
    check_rebuild(pack, seqs)
    assert pack.dataset_names == list(names[: len(src.blocks)])


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_packed_form_materializes_to_the_output(scenario) -> None:
    """``next_packed`` + ``materialize`` (what the shuffle buffer uses), ``materialize_into``
    and ``materialize_batch_into`` (what collate uses) give exactly what ``next`` gives."""
    kw, mode, shift, seq_len, lengths, marks, chunk, block_docs, window = scenario
    docs = make_corpus(lengths, marks, kw)
    names = ("web", "books") if chunk is None else ("web",)

    def make() -> Pack:
        src = ListSource(docs, block_docs=block_docs, max_chunksize=chunk, names=names)
        return Pack(src, seq_len, mode=mode, shift=shift, window=window, **kw)

    seqs = run(make())
    pack = make()
    pack.reset()
    packed = []
    while True:
        try:
            packed.append(pack.next_packed())
        except StopIteration:
            break
    assert [item_key(pack.materialize(p)) for p in packed] == [item_key(x) for x in seqs]
    for p, seq in zip(packed, seqs):
        assert set(pack.output_keys) == set(seq)
        assert len(p.tokens) == seq_len + shift
        assert np.array_equal(p.provenance, seq["provenance"])
        for dt in (np.int64, np.int32):
            out = {
                k: np.full((2, seq_len), -7, bool if k == "loss_mask" else dt)
                for k in pack.output_keys
                if k != "provenance"
            }
            pack.materialize_into(p, out, 1)
            for k, a in out.items():
                assert np.array_equal(a[1], seq[k]), k
                assert k == "loss_mask" or (a[0] == -7).all()
    for dt in (np.int64, np.int32) if packed else ():  # the whole run as one batch
        batch = {
            k: np.full((len(packed), seq_len), -7, bool if k == "loss_mask" else dt)
            for k in pack.output_keys
            if k != "provenance"
        }
        pack.materialize_batch_into(packed, batch)
        for k, a in batch.items():
            assert np.array_equal(a, np.stack([seq[k] for seq in seqs]).astype(a.dtype)), k


def test_a_document_cut_across_blocks_is_one_run() -> None:
    """Pieces of one document in consecutive blocks continue each other's run: one document
    id, positions counting on across the block boundary (and from 0 again in a new sequence)."""
    docs = [np.arange(UNIQUE, UNIQUE + 10), np.arange(UNIQUE + 10, UNIQUE + 14)]
    pack = Pack(ListSource(docs, block_docs=1, max_chunksize=3), 8, eos_token=EOS)
    seqs = run(pack)
    assert seqs[0]["position_ids"].tolist() == list(range(8))
    assert seqs[0]["document_ids"].tolist() == [0] * 8
    # the rest of document 0 (2 tokens and the EOS), then document 1 (4 tokens and the EOS)
    assert seqs[1]["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert seqs[1]["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    check_rebuild(pack, seqs)


# -- a real reader upstream ------------------------------------------------------------------------
def unique_docs(n: int, seed: int, lo: int = 1, hi: int = 30, sep: int | None = None):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi, size=n)
    docs = make_corpus(lengths, [(False, False)] * n, {})
    if sep is not None:  # some documents begin or end with the separator
        for i, d in enumerate(docs):
            if i % 5 == 0:
                d[0] = sep
            if i % 7 == 0:
                d[-1] = sep
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("packc") / "web"
    root.mkdir()
    docs = unique_docs(40, 1, sep=EOS)
    write_arrow_batches(str(root / "a.arrow"), docs[:25], dtype=np.uint32)
    write_arrow_batches(str(root / "b.arrow"), docs[25:], dtype=np.uint32)
    return DatasetIndex.build(str(root)), docs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A short stream for restoring at every step: 14 documents, ~230 tokens an epoch."""
    root = tmp_path_factory.mktemp("packt") / "web"
    root.mkdir()
    docs = unique_docs(14, 2, hi=34, sep=EOS)
    write_arrow_batches(str(root / "a.arrow"), docs[:9], dtype=np.uint32)
    write_arrow_batches(str(root / "b.arrow"), docs[9:], dtype=np.uint32)
    return DatasetIndex.build(str(root)), docs


def reader_order(index, docs, **kw) -> list[np.ndarray]:
    """The documents in the order the reader delivers them (pieces joined)."""
    offsets = np.concatenate([[0], np.cumsum(index.doc_counts)])
    out: list[np.ndarray] = []
    for block in run(ShardReader(index, 4, world=World(), epochs=1, **kw)):
        for d in block:
            if d.start == 0:
                out.append(docs[offsets[d.file] + d.doc])
    return out


@settings(
    max_examples=35, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(scenarios(), st.integers(0, 3))
def test_with_reader_chunks(corpus, scenario, seed) -> None:
    index, docs = corpus
    kw, mode, shift, seq_len, _, _, chunk, block_docs, window = scenario
    rkw = dict(block_docs=block_docs, max_chunksize=chunk, seed=seed)
    reader = ShardReader(index, 4, world=World(), epochs=1, **rkw)
    pack = Pack(reader, seq_len, mode=mode, shift=shift, window=window, **kw)
    seqs = run(pack)
    check_packed(
        seqs, reader_order(index, docs, **rkw), kw, mode, seq_len, shift, chunk is not None
    )
    check_rebuild(pack, seqs)


CONFIGS = [
    dict(mode="concat", seq_len=16, eos_token=0),
    dict(mode="concat", seq_len=9, bos_token=BOS, eos_token=EOS, bol_token=BOL, shift=True),
    dict(mode="pad", seq_len=12, bos_token=EOS, eos_token=EOS, eol_token=EOL, pad_token=PADT),
    dict(mode="pad", seq_len=20, eos_token=0, shift=True),
    dict(mode="best_fit", seq_len=16, eos_token=EOS, window=7),
    dict(mode="best_fit", seq_len=10, bos_token=BOS, bol_token=BOL, eol_token=EOL, window=5),
]
READERS = [dict(block_docs=3), dict(block_docs=2, max_chunksize=7)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c['mode']}-{c['seq_len']}")
@pytest.mark.parametrize("rkw", READERS, ids=["whole", "chunked"])
def test_restore_at_every_step_across_epochs(tiny, cfg, rkw) -> None:
    index, docs = tiny

    def make():
        return Pack(ShardReader(index, 4, world=World(), epochs=2, seed=3, **rkw), **cfg)

    items = check_restore_at_every_step(make)
    assert len(items) > 15
    # the stream crossed the epoch boundary: every document token twice
    toks = collections.Counter(
        int(t) for s in items for t in packed_tokens(s, cfg.get("shift", False)) if t >= UNIQUE
    )
    assert set(toks.values()) == {2} and len(toks) == sum(int((d >= UNIQUE).sum()) for d in docs)
    pack = make()
    check_rebuild(pack, run(pack))
    check_loader_restore(make, steps=len(items), at=[0, 1, 5, len(items) // 2, len(items) - 1])


def test_restore_two_datasets_learns_names_in_order(corpus) -> None:
    def make():
        src = ListSource(unique_docs(30, 5), block_docs=2, names=("a", "b", "c"))
        return Pack(src, 8, mode="best_fit", window=4, bos_token=BOS, bol_token=BOL)

    items = check_restore_at_every_step(make)
    pack = make()
    seqs = run(pack)
    assert pack.dataset_names == ["a", "b", "c"]
    assert {int(d) for s in seqs for d in s["provenance"][:, 0]} >= {0, 1, 2, LITERAL}
    assert [item_key(x) for x in items] == [item_key(x) for x in seqs]


def test_states_are_small_plain_and_hold_no_tokens(corpus) -> None:
    index, _ = corpus
    for mode in ("concat", "pad", "best_fit"):
        pack = Pack(ShardReader(index, 4, world=World()), 64, mode=mode, eos_token=0, window=50)
        for _ in range(30):
            next(pack)
            state = pack.state_dict()
            mine = {k: v for k, v in state.items() if k != "source"}
            assert _plain(mine), mine
            assert set(mine) == {
                "format", "mode", "seq_len", "shift", "consumed", "bins", "open_docs",
                "bos_done", "dataset_names", "settings",
            }  # fmt: skip
            assert len(pickle.dumps(state)) < 4000
        assert state["source"]["dataset"] == "web"


def _plain(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_plain(v) for v in x)
    return isinstance(x, (int, float, str, bool)) or x is None


# -- finite runs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["concat", "pad", "best_fit"])
def test_finite_run_flushes_the_last_sequence_padded(corpus, mode) -> None:
    index, docs = corpus
    rkw = dict(block_docs=4, max_chunksize=9)

    def make(flush):
        reader = ShardReader(index, 4, world=World(), epochs=1, **rkw)
        return Pack(reader, 32, mode=mode, eos_token=0, window=5, flush=flush)

    seqs = check_restore_at_every_step(lambda: make(True))
    check_packed(seqs, reader_order(index, docs, **rkw), {"eos_token": 0}, mode, 32, False, True)
    last = seqs[-1]
    assert mode == "best_fit" or not last["loss_mask"][-1]  # padded
    assert (last["input_ids"][~last["loss_mask"]] == 0).all()
    assert sum(int(s["loss_mask"].sum()) for s in seqs) == sum(len(d) + 1 for d in docs)
    dropped = check_restore_at_every_step(lambda: make(False))
    if mode == "best_fit":  # the incomplete last window (of 5 pieces) is dropped
        n_pieces = sum(len(b) for b in run(ShardReader(index, 4, world=World(), epochs=1, **rkw)))
        assert n_pieces % 5 and 0 < len(dropped) < len(seqs)
        assert [item_key(x) for x in dropped] == [item_key(x) for x in seqs[: len(dropped)]]
    else:
        assert [item_key(x) for x in dropped] == [item_key(x) for x in seqs[:-1]]


def test_concat_without_specials_is_a_plain_cut() -> None:
    docs = [np.arange(100, 107), np.arange(200, 203), np.arange(300, 312)]
    seqs = run(Pack(ListSource(docs, block_docs=2), 5))
    flat = np.concatenate(docs)
    assert [s["input_ids"].tolist() for s in seqs[:-1]] == flat[:20].reshape(4, 5).tolist()
    assert seqs[-1]["input_ids"].tolist() == [310, 311, 0, 0, 0]
    assert seqs[1]["position_ids"].tolist() == [0, 1, 0, 1, 2]  # doc 0 continues, restarts at 0
    assert seqs[1]["document_ids"].tolist() == [0, 0, 1, 1, 1]
    assert seqs[-1]["loss_mask"].tolist() == [True, True, False, False, False]
    assert seqs[-1]["provenance"].tolist() == [[0, 0, 2, 10, 2], [PAD, 0, 0, 0, 3]]


def test_shift_packs_one_more_token_and_does_not_reuse_it() -> None:
    docs = [np.arange(100, 111)]
    seqs = run(Pack(ListSource(docs), 4, shift=True, flush=False))
    assert [s["input_ids"].tolist() for s in seqs] == [[100, 101, 102, 103], [105, 106, 107, 108]]
    assert [s["labels"].tolist() for s in seqs] == [[101, 102, 103, 104], [106, 107, 108, 109]]


def test_bamba_eos_equals_pad_and_bos_eos_not_doubled() -> None:
    docs = [np.array([100, 101]), np.array([102, 0]), np.array([1, 103])]
    pack = Pack(ListSource(docs), 6, mode="pad", eos_token=0)
    seqs = run(pack)
    assert [s["input_ids"].tolist() for s in seqs] == [
        [100, 101, 0, 102, 0, 0],
        [1, 103, 0, 0, 0, 0],
    ]
    assert [s["loss_mask"].tolist() for s in seqs] == [
        [True] * 5 + [False],
        [True] * 3 + [False] * 3,
    ]
    assert seqs[1]["document_ids"].tolist() == [0, 0, 0, -1, -1, -1]
    assert seqs[0]["provenance"][-1].tolist() == [PAD, 0, 0, 0, 1]
    check_rebuild(pack, seqs)
    # bos == eos: one separator per document, none where either end already has it
    seqs = run(Pack(ListSource(docs), 20, bos_token=0, eos_token=0))
    assert seqs[0]["input_ids"][:8].tolist() == [100, 101, 0, 102, 0, 1, 103, 0]
    # a chunked document that begins with the separator gets none at its end, across blocks
    docs = [np.array([0, 100, 101, 102, 103]), np.array([104, 105])]
    seqs = run(Pack(ListSource(docs, block_docs=1, max_chunksize=2), 10, bos_token=0, eos_token=0))
    assert seqs[0]["input_ids"].tolist() == [0, 100, 101, 102, 103, 104, 105, 0, 0, 0]
    assert seqs[0]["document_ids"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, -1, -1]


def test_best_fit_packs_tighter_than_concat_order_pad() -> None:
    rng = np.random.default_rng(0)
    docs = [
        np.arange(1000 * i + 100, 1000 * i + 100 + n)
        for i, n in enumerate(rng.integers(1, 60, 200))
    ]
    pad = run(Pack(ListSource(docs, block_docs=16), 64, mode="pad"))
    best = run(Pack(ListSource(docs, block_docs=16), 64, mode="best_fit", window=200))
    n_tokens = sum(len(d) for d in docs)
    assert n_tokens / 64 < len(best) <= 1.08 * n_tokens / 64 < 0.9 * len(pad)


def test_best_fit_takes_the_fullest_bin_that_fits() -> None:
    # decreasing: 7 -> bin 0, 6 -> bin 1, 3 -> bin 0 (room 3, not bin 1's 4), 2 -> bin 1
    docs = [np.arange(100 * k, 100 * k + n) for k, n in zip((1, 2, 3, 4), (3, 7, 2, 6))]
    seqs = run(Pack(ListSource(docs, block_docs=4), 10, mode="best_fit", window=4))
    assert [s["input_ids"].tolist() for s in seqs] == [
        [100, 101, 102, *range(200, 207)],  # bins in arrival order of their first piece
        [300, 301, *range(400, 406), 0, 0],
    ]
    assert seqs[1]["document_ids"].tolist() == [0, 0] + [1] * 6 + [-1, -1]


def test_long_documents_in_best_fit_fill_whole_sequences() -> None:
    docs = [np.arange(100, 125), np.arange(200, 203)]  # 25 = 3 + 2 x 11 with eos: 26 = 4 + 22
    seqs = run(Pack(ListSource(docs), 11, mode="best_fit", eos_token=EOS))
    got = [s["input_ids"].tolist() for s in seqs]
    assert got == [
        [100, 101, 102, 103, 200, 201, 202, 2, 0, 0, 0],
        list(range(104, 115)),
        [*range(115, 125), 2],
    ]
    assert seqs[0]["document_ids"].tolist() == [0] * 4 + [1] * 4 + [-1] * 3


# -- errors ---------------------------------------------------------------------------------------
def test_bad_arguments_name_the_argument() -> None:
    src = ListSource([np.arange(100, 110)])
    with pytest.raises(ValueError, match="seq_len=0 must be >= 1"):
        Pack(src, 0)
    with pytest.raises(ValueError, match="seq_len=-3 must be >= 1"):
        Pack(src, -3)
    with pytest.raises(TypeError, match="seq_len=8.0 must be an integer"):
        Pack(src, 8.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seq_len=True must be an integer"):
        Pack(src, True)
    with pytest.raises(ValueError, match="seq_len=2 leaves no room .* at least 3"):
        Pack(src, 2, bol_token=BOL, eol_token=EOL)
    Pack(src, 2, bol_token=BOL, eol_token=EOL, shift=True)  # 3 packed tokens: fits
    with pytest.raises(ValueError, match="mode='greedy' is not a packing mode"):
        Pack(src, 8, mode="greedy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window=0 must be >= 1"):
        Pack(src, 8, mode="best_fit", window=0)
    with pytest.raises(ValueError, match="eos_token=-1 must be >= 0"):
        Pack(src, 8, eos_token=-1)
    with pytest.raises(ValueError, match="bos_token=70000 does not fit dtype int16"):
        Pack(src, 8, bos_token=70000, dtype=np.int16)
    with pytest.raises(TypeError, match="dtype=.*float.* must be an integer dtype"):
        Pack(src, 8, dtype=np.float32)
    with pytest.raises(TypeError, match="shift=1 must be True or False"):
        Pack(src, 8, shift=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="source must be a torchdata.nodes.BaseNode"):
        Pack([1, 2], 8)  # type: ignore[arg-type]


def test_text_blocks_say_tokenize_first(tmp_path) -> None:
    write_jsonl(str(tmp_path / "t.jsonl"), ["some text", "more text"])
    index = DatasetIndex.build(str(tmp_path / "t.jsonl"))
    pack = Pack(ShardReader(index, 1, world=World()), 8)
    with pytest.raises(TypeError, match="text block .* tokenize first"):
        next(pack)


def test_restore_refuses_other_settings(corpus) -> None:
    index, _ = corpus
    pack = Pack(ShardReader(index, 4, world=World()), 16)
    next(pack)
    state = pack.state_dict()
    with pytest.raises(ValueError, match="checkpoint has seq_len=16 but this Pack has seq_len=8"):
        Pack(ShardReader(index, 4, world=World()), 8).reset(state)
    with pytest.raises(ValueError, match="mode='concat'"):
        Pack(ShardReader(index, 4, world=World()), 16, mode="pad").reset(state)


def test_fetch_document_delegates_to_the_source(corpus) -> None:
    index, docs = corpus
    pack = Pack(ShardReader(index, 4, world=World()), 16)
    assert np.array_equal(pack.fetch_document("web", 1, 3), docs[28])
