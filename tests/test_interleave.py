"""Interleave: token shares on target, the fast run rule equals the one-document rule, epochs of
small sources, finite sources, exact resume, fetch_document routing."""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np
import pytest
from harness import check_loader_restore, check_restore_at_every_step, item_key, run
from hypothesis import given, settings
from hypothesis import strategies as st
from torchdata.nodes import BaseNode

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.document import DocumentBlock
from torchdata_ext.nodes.interleave import _SAMPLES_TAG, Interleave, _counter_uniforms
from torchdata_ext.nodes.tokenize import Tokenize
from torchdata_ext.order.walk import mix_seed
from torchdata_ext.state.graph import is_reader_state
from torchdata_ext.state.reader_state import reader_cursors
from torchdata_ext.testing import write_arrow_batches, write_jsonl
from torchdata_ext.tokenizers.load import ByteTokenizer


# -- in-memory sources and the slow reference ---------------------------------------------------
class ListSource(BaseNode[DocumentBlock]):
    """Blocks of given piece lengths; doc ids count up per source; endless sources repeat with
    the epoch counting up. State: ``{"i": blocks delivered}``."""

    def __init__(self, name: str, blocks: list[list[int]], endless: bool = False) -> None:
        super().__init__()
        self.name, self.blocks, self.endless = name, blocks, endless
        self.i = 0

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.i = 0 if initial_state is None else initial_state["i"]

    def next(self) -> DocumentBlock:
        nb = len(self.blocks)
        if not self.endless and self.i >= nb:
            raise StopIteration
        epoch, j = divmod(self.i, nb)
        self.i += 1
        lengths = self.blocks[j]
        first = sum(len(b) for b in self.blocks[:j])
        ids = list(range(first, first + len(lengths)))
        pieces = [np.full(n, d, np.int32) for n, d in zip(lengths, ids)]
        k = len(ids)
        return DocumentBlock.from_pieces(
            self.name, pieces, [0] * k, ids, [0] * k, [True] * k, epoch=epoch
        )

    def get_state(self) -> dict:
        return {"i": self.i}


def reference(
    sources: dict[str, list[list[int]]],
    weights: dict[str, float],
    mode: str,
    seed: int,
    endless: bool,
    max_docs: int,
) -> list[tuple[str, int, int]]:
    """The mix one document at a time, in plain Python: (dataset, epoch, doc) per document."""
    names = list(sources)
    docs = {n: [d for b in sources[n] for d in b] for n in names}
    pos = {n: 0 for n in names}
    epoch = {n: 0 for n in names}
    delivered = {n: 0 for n in names}
    ended = {n: False for n in names}
    key = mix_seed(seed, _SAMPLES_TAG)
    counter = 0
    out: list[tuple[str, int, int]] = []
    while len(out) < max_docs:
        active = [n for n in names if not ended[n]]
        if not active:
            break
        if mode == "tokens":
            s = min(active, key=lambda n: delivered[n] / float(weights[n]))  # ties: first
        else:
            u = float(_counter_uniforms(key, counter, 1)[0])
            cum = np.cumsum([float(weights[n]) for n in active])
            k = int(np.searchsorted(cum, u * cum[-1], side="right"))
            s = active[min(k, len(active) - 1)]
        if pos[s] >= len(docs[s]):
            if endless:
                pos[s], epoch[s] = 0, epoch[s] + 1
            else:
                ended[s] = True
                continue
        out.append((s, epoch[s], pos[s]))
        delivered[s] += docs[s][pos[s]]
        pos[s] += 1
        counter += 1
    return out


def flatten(blocks) -> list[tuple[str, int, int]]:
    return [(b.dataset, b.epoch, int(d)) for b in blocks for d in b.doc]


def take_docs(node: BaseNode, max_docs: int) -> list[tuple[str, int, int]]:
    out: list[tuple[str, int, int]] = []
    for block in node:
        assert len(block) > 0
        out += flatten([block])
        if len(out) >= max_docs:
            break
    return out[:max_docs]


block_lists = st.lists(
    st.lists(st.sampled_from([0, 1, 2, 3, 5, 8, 13, 40, 100]), max_size=6), max_size=5
)
mixes = st.dictionaries(
    st.sampled_from(["a", "b", "c", "d"]),
    st.tuples(block_lists, st.sampled_from([0.1, 0.5, 1, 1.5, 2, 3, 7])),
    min_size=1,
    max_size=4,
)


def build(mix, mode, seed, endless) -> Interleave:
    return Interleave(
        {n: ListSource(n, blocks, endless) for n, (blocks, _) in mix.items()},
        {n: w for n, (_, w) in mix.items()},
        mode=mode,
        seed=seed,
    )


@settings(max_examples=400, deadline=None)
@given(mixes, st.sampled_from(["tokens", "samples"]), st.integers(0, 3), st.booleans())
def test_fast_runs_equal_the_one_document_reference(mix, mode, seed, endless) -> None:
    if endless:  # an endless source needs a document to give
        mix = {n: (b if any(b) else [[1]], w) for n, (b, w) in mix.items()}
    want = reference(
        {n: b for n, (b, _) in mix.items()},
        {n: w for n, (_, w) in mix.items()},
        mode,
        seed,
        endless,
        150,
    )
    node = build(mix, mode, seed, endless)
    got = take_docs(node, 150)
    assert got == want
    if not endless:  # finite: every document once, then the end
        assert len(got) == sum(len(b) for blocks, _ in mix.values() for b in blocks)
        with pytest.raises(StopIteration):
            next(node)


@settings(max_examples=60, deadline=None)
@given(mixes, st.sampled_from(["tokens", "samples"]), st.booleans())
def test_restore_at_every_step_small_mixes(mix, mode, endless) -> None:
    if endless:
        mix = {n: (b if any(b) else [[1]], w) for n, (b, w) in mix.items()}
    check_restore_at_every_step(
        lambda: build(mix, mode, 1, endless), max_steps=25 if endless else None
    )


def test_ties_go_to_the_first_source() -> None:
    mix = {"b": ([[5, 5, 5]], 1.0), "a": ([[5, 5, 5]], 1.0)}
    got = take_docs(build(mix, "tokens", 0, False), 6)
    assert [n for n, _, _ in got] == ["b", "a", "b", "a", "b", "a"]


def test_counter_uniforms_are_a_pure_function_of_the_counter() -> None:
    u = _counter_uniforms(12345, 0, 100_000)
    assert np.array_equal(_counter_uniforms(12345, 777, 5), u[777:782])
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.005
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02
    assert not np.array_equal(_counter_uniforms(12346, 0, 10), u[:10])


# -- real readers ---------------------------------------------------------------------------------
SPEC = {  # name: (documents, length range) -> mean lengths ~50, ~400, ~2000 tokens
    "web": (3000, (1, 100)),
    "books": (500, (1, 800)),
    "code": (150, (1, 4000)),
    "tiny": (30, (1, 100)),  # 100x fewer documents than web
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Arrow (Bamba layout) datasets; each document's first token is a unique id."""
    root = tmp_path_factory.mktemp("mix")
    out: dict[str, Any] = {}
    for k, (name, (n, (lo, hi))) in enumerate(SPEC.items()):
        rng = np.random.default_rng(k)
        docs = [
            np.concatenate(
                [[1_000_000 * (k + 1) + i], rng.integers(0, 50_000, int(rng.integers(lo, hi)) - 1)]
            ).astype(np.uint32)
            for i in range(n)
        ]
        (root / name).mkdir()
        cut = n // 3
        write_arrow_batches(str(root / name / "a.arrow"), docs[:cut])
        write_arrow_batches(str(root / name / "b.arrow"), docs[cut:])
        out[name] = (DatasetIndex.build(str(root / name)), docs)
    return out


def readers(data, names, epochs=None, block_docs=64, **kw) -> dict[str, ShardReader]:
    return {
        n: ShardReader(
            data[n][0], 4, world=World(), seed=7, epochs=epochs, block_docs=block_docs, **kw
        )
        for n in names
    }


def test_token_shares_on_target(data) -> None:
    weights = {"web": 3.0, "books": 1.0, "code": 1.0}
    node = Interleave(readers(data, weights), weights)
    target = {n: w / 5 for n, w in weights.items()}
    max_len = {n: SPEC[n][1][1] for n in weights}
    got = dict.fromkeys(weights, 0)
    total = 0
    while total < 1_000_000:
        block = next(node)
        assert len(set(block.file.tolist())) == 1 and block.dataset in weights
        got[block.dataset] += block.num_tokens
        total += block.num_tokens
        if total > 50_000:  # the argmin rule keeps every share within sum(max lengths) / total
            for n in weights:
                assert abs(got[n] / total - target[n]) <= sum(max_len.values()) / total
    for n in weights:
        assert abs(got[n] / total - target[n]) <= 0.005, (n, got[n] / total)
    assert node.state_dict()["tokens_delivered"] == got
    assert all(type(v) is int for v in node.state_dict()["tokens_delivered"].values())


def test_sample_shares_on_target(data) -> None:
    weights = {"web": 3.0, "books": 1.0, "code": 1.0}
    node = Interleave(readers(data, weights), weights, mode="samples", seed=11)
    docs = collections.Counter()
    draws = 0
    runs = 0
    while draws < 20_000:
        block = next(node)
        docs[block.dataset] += len(block)
        draws += len(block)
        runs += 1
    assert runs < draws  # runs of one source come out as one block
    for n, w in weights.items():
        p = w / 5
        sigma = math.sqrt(p * (1 - p) / draws)
        assert abs(docs[n] / draws - p) <= 5 * sigma, (n, docs[n] / draws, p)

    def first_docs(seed: int) -> list[tuple[str, int, int]]:
        return flatten(
            run(Interleave(readers(data, weights), weights, mode="samples", seed=seed), 50)
        )

    assert first_docs(11) == first_docs(11) != first_docs(12)


@pytest.mark.parametrize("mode", ["tokens", "samples"])
def test_small_source_cycles_its_epochs_without_repeats(data, mode) -> None:
    weights = {"web": 1.0, "tiny": 1.0}
    node = Interleave(readers(data, weights, block_docs=8), weights, mode=mode)
    per_epoch: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    order_first_token = collections.defaultdict(list)
    for block in run(node, 400):
        if block.dataset == "tiny":
            for d in block:
                per_epoch[d.epoch].append((d.file, d.doc))
                order_first_token[d.epoch].append(int(d.data[0]))
    epochs = sorted(per_epoch)
    assert epochs == list(range(len(epochs))) and len(epochs) >= 4
    n_tiny = SPEC["tiny"][0]
    for e in epochs:
        assert len(per_epoch[e]) == len(set(per_epoch[e]))  # no repeat inside an epoch
    for e in epochs[:-1]:  # complete epochs hold every document
        assert len(per_epoch[e]) == n_tiny
        assert sorted(order_first_token[e]) == [4_000_000 + i for i in range(n_tiny)]
    assert order_first_token[0] != order_first_token[1]  # reshuffled per epoch


@pytest.mark.parametrize("mode", ["tokens", "samples"])
def test_restore_at_every_step_across_epochs(data, mode) -> None:
    weights = {"books": 2.0, "tiny": 1.0}
    items = check_restore_at_every_step(
        lambda: Interleave(readers(data, weights, block_docs=6), weights, mode=mode, seed=3),
        max_steps=70,
    )
    tiny_epochs = {b.epoch for b in items if b.dataset == "tiny"}
    assert len(tiny_epochs) >= 2  # the restores cross the small source's epoch boundary
    assert {b.dataset for b in items} == set(weights)


def test_restore_through_loader(data) -> None:
    weights = {"web": 1.0, "tiny": 1.0, "code": 0.5}
    check_loader_restore(
        lambda: Interleave(readers(data, weights, block_docs=5), weights),
        steps=60,
        at=[0, 1, 17, 59],
    )


@pytest.mark.parametrize("mode", ["tokens", "samples"])
def test_finite_sources_deliver_everything_once_then_stop(data, mode) -> None:
    weights = {"tiny": 1.0, "code": 2.0, "books": 0.5}
    make = lambda: Interleave(  # noqa: E731
        readers(data, weights, epochs=1, block_docs=16), weights, mode=mode
    )
    items = run(make())
    got = collections.Counter((b.dataset, int(d.data[0])) for b in items for d in b)
    want = collections.Counter((n, int(doc[0])) for n in weights for doc in data[n][1])
    assert got == want
    node = make()
    run(node)
    with pytest.raises(StopIteration):
        next(node)
    state = node.state_dict()
    assert all(s["ended"] for s in state["sources"].values())
    # and with restores at every step (the end included)
    small = {"tiny": 1.0, "code": 0.3}
    check_restore_at_every_step(
        lambda: Interleave(readers(data, small, epochs=1, block_docs=7), small, mode=mode)
    )


def test_state_layout(data) -> None:
    weights = {"tiny": 1.0, "code": 1.0}
    node = Interleave(readers(data, weights, block_docs=8), weights)
    run(node, 5)
    state = node.state_dict()
    assert set(state) == {
        "sources", "tokens_delivered", "weights", "counter", "settings", "row_fill", "finishing",
        "cuts_handed_back",
    }  # fmt: skip
    assert state["row_fill"] is None and state["finishing"] is None  # no Pack follows it here
    assert state["cuts_handed_back"] is True  # a rescale's hand-back is cut at row ends too
    assert state["settings"] == {"interleave_mode": "tokens", "mix_quantum_tokens": 0}
    assert state["weights"] == weights
    assert list(state["sources"]) == ["tiny", "code"]
    for s in state["sources"].values():
        assert set(s) == {"source", "consumed", "offset", "ended"}
        assert is_reader_state(s["source"]) and 0 <= s["consumed"] < 8 and s["ended"] is False
        assert s["offset"] == 0
    assert state["counter"] == 0  # tokens mode draws nothing


def test_fetch_document_routes_to_the_owner(data) -> None:
    weights = {"web": 1.0, "books": 1.0, "code": 1.0}
    node = Interleave(readers(data, weights), weights)
    for block in run(node, 30):
        for d in block:
            assert np.array_equal(node.fetch_document(d.dataset, d.file, d.doc), d.data)
    fresh = Interleave(readers(data, weights), weights)  # nothing read yet: asks the sources
    b = data["code"][0]
    assert int(fresh.fetch_document("code", 1, 3)[0]) == int(
        data["code"][1][b.doc_counts[0] + 3][0]
    )
    with pytest.raises(KeyError, match="no source of this Interleave reads dataset 'nope'"):
        fresh.fetch_document("nope", 0, 0)


def test_text_through_tokenize_mixed_with_tokens(data, tmp_path) -> None:
    """Interleave over a prefetching Tokenize (text) and a token reader: exact resume, and
    fetch_document routes through Tokenize to the text reader."""
    (tmp_path / "notes").mkdir()
    texts = [f"note {i}: " + "é" * (i % 7) + "x" * (3 * i) for i in range(20)]
    write_jsonl(str(tmp_path / "notes" / "n.jsonl"), texts)
    notes = DatasetIndex.build(str(tmp_path / "notes"))
    tok = ByteTokenizer(offset=2, bos_token=0, eos_token=1)

    def make() -> Interleave:
        text = ShardReader(notes, 4, world=World(), seed=1, block_docs=6)
        srcs = {
            "notes": Tokenize(text, tok, bos_token=0, eos_token=1, num_threads=2, prefetch=3),
            **readers(data, ["tiny"], block_docs=5),
        }
        return Interleave(srcs, {"notes": 1.0, "tiny": 1.0})

    items = check_restore_at_every_step(make, max_steps=60)
    assert {b.dataset for b in items} == {"notes", "tiny"}
    assert {b.epoch for b in items if b.dataset == "notes"} >= {0, 1}
    node = make()
    for block in run(node, 30):
        for d in block:
            assert np.array_equal(node.fetch_document(d.dataset, d.file, d.doc), d.data)
            if d.dataset == "notes":
                assert tok.decode(d.data) == texts[d.doc] and d.data[0] == 0 and d.data[-1] == 1


def test_bad_arguments_name_the_problem(data) -> None:
    src = readers(data, ["tiny", "web"])
    with pytest.raises(ValueError, match=r"weights\['web'\]=0 must be"):
        Interleave(src, {"tiny": 1, "web": 0})
    with pytest.raises(ValueError, match=r"weights\['web'\]=-1.0 must be"):
        Interleave(src, {"tiny": 1, "web": -1.0})
    with pytest.raises(ValueError, match=r"weights\['web'\]=nan"):
        Interleave(src, {"tiny": 1, "web": float("nan")})
    with pytest.raises(ValueError, match=r"no entry for source\(s\) \['web'\]"):
        Interleave(src, {"tiny": 1})
    with pytest.raises(ValueError, match=r"weights names \['wiki'\], which are not sources"):
        Interleave(src, {"tiny": 1, "web": 1, "wiki": 1})
    with pytest.raises(ValueError, match="sources is empty"):
        Interleave({}, {})
    with pytest.raises(ValueError, match="mode='mixed'"):
        Interleave(src, {"tiny": 1, "web": 1}, mode="mixed")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"sources\['web'\] must be a torchdata.nodes.BaseNode"):
        Interleave({"web": [1]}, {"web": 1})  # type: ignore[dict-item]
    node = Interleave(src, {"tiny": 1, "web": 1})
    state = node.state_dict()
    other = Interleave(readers(data, ["tiny", "code"]), {"tiny": 1, "code": 1})
    with pytest.raises(ValueError, match="restore with the same source names"):
        other.reset(state)


def test_quantum_takes_longer_runs_and_keeps_the_mix() -> None:
    """With quantum_tokens the runs are longer but every share stays within its bound."""
    from torchdata.nodes import IterableWrapper

    from torchdata_ext.document import DocumentBlock

    def source(name: str, length: int) -> IterableWrapper:
        def blocks():
            i = 0
            while True:
                n = 256
                pieces = [np.full(length, 7, np.int32)] * n
                yield DocumentBlock.from_pieces(
                    name, pieces, [0] * n, list(range(i, i + n)), [0] * n, [True] * n
                )
                i += n

        return IterableWrapper(blocks())

    def run_mix(quantum: int):
        node = Interleave(
            {"a": source("a", 10), "b": source("b", 30)},
            {"a": 3.0, "b": 1.0},
            quantum_tokens=quantum,
        )
        tokens = {"a": 0, "b": 0}
        blocks = 0
        while sum(tokens.values()) < 200_000:
            blk = next(node)
            tokens[blk.dataset] += blk.num_tokens
            blocks += 1
            total = sum(tokens.values())
            bound = (quantum + 30) / total + 1e-9
            assert abs(tokens["a"] / total - 0.75) <= bound
        return blocks

    exact, coarse = run_mix(0), run_mix(2000)
    assert coarse < exact / 10


# -- documents cut into pieces (max_chunksize): each is finished before the next decision -------
class PieceSource(BaseNode[DocumentBlock]):
    """Documents of given lengths cut into pieces of at most ``chunk`` tokens, ``block_docs``
    pieces a block, so a block may end inside a document; endless sources repeat with the epoch
    counting up. State: ``{"i": blocks delivered}``."""

    def __init__(self, name: str, lengths: list[int], chunk: int, block_docs: int, endless: bool):
        super().__init__()
        self.name, self.endless = name, endless
        cut = [(d, a, min(n - a, chunk), a + chunk >= n) for d, n in enumerate(lengths)
               for a in range(0, n, chunk)]  # fmt: skip
        self.pieces = cut  # (doc, start, length, last)
        self.blocks = [cut[i : i + block_docs] for i in range(0, len(cut), block_docs)]
        self.i = 0

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.i = 0 if initial_state is None else initial_state["i"]

    def next(self) -> DocumentBlock:
        if not self.blocks or (not self.endless and self.i >= len(self.blocks)):
            raise StopIteration
        epoch, j = divmod(self.i, len(self.blocks))
        self.i += 1
        doc, start, length, last = zip(*self.blocks[j])
        data = [np.full(n, d, np.int32) for d, n in zip(doc, length)]
        return DocumentBlock.from_pieces(
            self.name, data, [0] * len(doc), doc, start, last, epoch=epoch
        )

    def get_state(self) -> dict:
        return {"i": self.i}


def piece_reference(
    sources: dict[str, PieceSource],
    weights: dict[str, float],
    mode: str,
    seed: int,
    max_pieces: int,
) -> list[tuple[str, int, int, int]]:
    """The mix one piece at a time, in plain Python: a document in progress goes on, else the
    mode's rule decides (one draw per document). ``(dataset, epoch, doc, start)`` per piece."""
    names = list(sources)
    pos = dict.fromkeys(names, 0)
    delivered = dict.fromkeys(names, 0)
    ended = dict.fromkeys(names, False)
    key = mix_seed(seed, _SAMPLES_TAG)
    counter, open_ = 0, None
    out: list[tuple[str, int, int, int]] = []
    while len(out) < max_pieces:
        active = [n for n in names if not ended[n]]
        if not active:
            break
        drawn = open_ is None
        if open_ is not None:
            s = open_
        elif mode == "tokens":
            s = min(active, key=lambda n: delivered[n] / weights[n])
        else:
            u = float(_counter_uniforms(key, counter, 1)[0])
            cum = np.cumsum([weights[n] for n in active])
            s = active[min(int(np.searchsorted(cum, u * cum[-1], side="right")), len(active) - 1)]
        pieces = sources[s].pieces
        if not pieces or (not sources[s].endless and pos[s] >= len(pieces)):
            ended[s], open_ = True, None
            continue
        epoch, j = divmod(pos[s], len(pieces))
        doc, start, length, last = pieces[j]
        out.append((s, epoch, doc, start))
        delivered[s] += length
        pos[s] += 1
        counter += drawn
        open_ = None if last else s
    return out


piece_mixes = st.dictionaries(
    st.sampled_from(["a", "b", "c"]),
    st.tuples(
        st.lists(st.integers(1, 40), max_size=8),
        st.sampled_from([1, 2, 3, 7, 100]),  # chunk
        st.sampled_from([1, 2, 3, 5]),  # block_docs
        st.sampled_from([0.2, 1.0, 2.0, 5.0]),
    ),
    min_size=1,
    max_size=3,
)


def build_pieces(mix, mode: str, seed: int, endless: bool) -> Interleave:
    return Interleave(
        {n: PieceSource(n, lens, c, b, endless) for n, (lens, c, b, _) in mix.items()},
        {n: w for n, (*_, w) in mix.items()},
        mode=mode,
        seed=seed,
    )


def piece_keys(blocks) -> list[tuple[str, int, int, int]]:
    return [(b.dataset, b.epoch, int(d), int(a)) for b in blocks for d, a in zip(b.doc, b.start)]


@settings(max_examples=300, deadline=None)
@given(piece_mixes, st.sampled_from(["tokens", "samples"]), st.integers(0, 3), st.booleans())
def test_cut_documents_are_finished_before_the_next_decision(mix, mode, seed, endless) -> None:
    if endless:
        mix = {n: (lens or [1], c, b, w) for n, (lens, c, b, w) in mix.items()}
    node = build_pieces(mix, mode, seed, endless)
    want = piece_reference(
        {n: PieceSource(n, lens, c, b, endless) for n, (lens, c, b, _) in mix.items()},
        {n: w for n, (*_, w) in mix.items()},
        mode,
        seed,
        200,
    )
    got = piece_keys(take_blocks(node, 200))[:200]
    assert got == want
    # hence each document's pieces come together, in order
    runs = [(s, e, d) for i, (s, e, d, a) in enumerate(got) if a == 0 or i == 0]
    assert len(runs) == len(set(runs))
    for prev, cur in zip(got, got[1:]):
        if cur[3] > 0:
            assert cur[:3] == prev[:3] and prev[3] < cur[3]


def take_blocks(node: BaseNode, max_pieces: int) -> list[DocumentBlock]:
    out, n = [], 0
    for block in node:
        out.append(block)
        n += len(block)
        if n >= max_pieces:
            break
    return out


@settings(max_examples=60, deadline=None)
@given(piece_mixes, st.sampled_from(["tokens", "samples"]), st.booleans())
def test_restore_at_every_step_with_cut_documents(mix, mode, endless) -> None:
    if endless:
        mix = {n: (lens or [1], c, b, w) for n, (lens, c, b, w) in mix.items()}
    check_restore_at_every_step(
        lambda: build_pieces(mix, mode, 2, endless), max_steps=30 if endless else None
    )


@pytest.mark.parametrize("mode", ["tokens", "samples"])
def test_restore_at_every_step_with_readers_cutting_documents(data, mode) -> None:
    weights = {"books": 1.0, "code": 1.0, "tiny": 0.5}
    items = check_restore_at_every_step(
        lambda: Interleave(
            readers(data, weights, block_docs=3, max_chunksize=150), weights, mode=mode, seed=4
        ),
        max_steps=80,
    )
    assert any(not b.last[-1] for b in items)  # restores right after a document left open


def test_token_shares_on_target_with_max_chunksize(data) -> None:
    """Whole documents count, so a share stays within (longest document) / total of its target,
    and every document comes in one run."""
    weights = {"web": 3.0, "books": 1.0, "code": 1.0}
    node = Interleave(readers(data, weights, max_chunksize=64), weights)
    target = {n: w / 5 for n, w in weights.items()}
    bound = sum(SPEC[n][1][1] for n in weights)
    got = dict.fromkeys(weights, 0)
    total = 0
    open_doc = None
    while total < 1_000_000:
        block = next(node)
        for d in block:
            assert open_doc is None or open_doc == (d.dataset, d.file, d.doc)
            open_doc = None if d.last else (d.dataset, d.file, d.doc)
        got[block.dataset] += block.num_tokens
        total += block.num_tokens
        if total > 50_000:
            for n in weights:
                assert abs(got[n] / total - target[n]) <= bound / total
    for n in weights:
        assert abs(got[n] / total - target[n]) <= 0.005, (n, got[n] / total)


def test_sample_shares_count_documents_with_max_chunksize(data) -> None:
    """One draw per document: the document shares follow the weights however long the
    documents (the pieces of a long one take no draw of their own)."""
    weights = {"web": 3.0, "books": 1.0, "code": 1.0}
    node = Interleave(readers(data, weights, max_chunksize=32), weights, mode="samples", seed=2)
    docs = collections.Counter()
    while sum(docs.values()) < 20_000:
        block = next(node)
        docs[block.dataset] += int(block.last.sum())
    draws = sum(docs.values())
    for n, w in weights.items():
        p = w / 5
        assert abs(docs[n] / draws - p) <= 5 * math.sqrt(p * (1 - p) / draws), (n, docs[n] / draws)
    assert node.state_dict()["counter"] == draws + (not block.last[-1])


@pytest.mark.parametrize("mode", ["tokens", "samples"])
def test_inflight_reads_open_documents_to_their_end_and_changes_nothing(data, mode) -> None:
    """At a rescale cut no reader is left inside a document: inflight() reads on to a document
    end and reports those pieces too; the node's state and what it emits next stay the same."""
    weights = {"books": 1.0, "code": 1.0}

    def make() -> Interleave:
        return Interleave(
            readers(data, weights, block_docs=2, max_chunksize=40), weights, mode=mode, seed=1
        )

    cuts = 0
    for steps in range(1, 40):
        node = make()
        run(node, steps)
        state = node.state_dict()
        pieces = node.inflight()
        assert node.state_dict() == state
        for name in weights:  # every reader's cursor lies between documents
            st = node.sources[node.names.index(name)].state_dict()
            assert not reader_cursors(st).offset.any()
        held = {(ds, f, d): b for ds, f, d, _, b in pieces}
        for ds, f, d in held:  # each document reported runs to its end
            assert held[(ds, f, d)] == len(node.fetch_document(ds, f, d))
        cuts += bool(pieces)
        rest = [item_key(b) for b in run(node, 10)]
        again = make()
        again.reset(state)
        assert rest == [item_key(b) for b in run(again, 10)]
    assert cuts > 10
