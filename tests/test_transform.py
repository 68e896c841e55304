"""Document transforms: maps and filters on whole documents, exact under restore and rescale.

Every check compares the delivered documents with a reference computed by applying the same
functions to the raw documents, never just counts.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from harness import (
    check_exactly_once,
    check_restore_at_every_step,
    run,
    text_config,
    write_random_text_datasets,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_ext import World
from torchdata_ext.document import DocumentBlock
from torchdata_ext.nodes.reader import ShardReader
from torchdata_ext.nodes.transform import FilterDocuments, MapDocuments, TransformDocuments
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.state.reader_state import reader_cursors
from torchdata_ext.testing import write_arrow_batches, write_jsonl
from torchdata_ext.transforms import (
    Filter,
    Map,
    TransformError,
    drop_tokens,
    from_spec,
    length_filter,
    truncate,
)

BAD = 7  # a token some documents hold; drop_tokens removes them


# -- functions (module level: picklable for dataloader workers) --------------------------------
def reverse_and_grow(tokens: np.ndarray, meta) -> np.ndarray | None:
    """A length-changing map that also drops documents: doubles even-length documents
    (reversed copy appended), drops those whose first token is divisible by 5."""
    if len(tokens) and int(tokens[0]) % 5 == 0:
        return None
    if len(tokens) % 2 == 0:
        return np.concatenate([tokens, tokens[::-1]])
    return tokens[::-1].copy()


def no_bad(tokens: np.ndarray, meta) -> bool:
    return not bool((tokens == BAD).any())


def reference(docs: dict, steps: list) -> dict:
    """``docs`` (key -> tokens) after per-document Python versions of the steps."""
    out = {}
    for key, d in docs.items():
        x: np.ndarray | None = np.asarray(d)
        for step in steps:
            x = step(x)
            if x is None:
                break
        if x is not None:
            out[key] = x
    return out


def ref_grow(x):
    return reverse_and_grow(x, None)


def ref_no_bad(x):
    return x if no_bad(x, None) else None


def ref_min(n):
    return lambda x: x if len(x) >= n else None


def ref_trunc(n):
    return lambda x: x[:n]


# -- data ------------------------------------------------------------------------------------
def make_docs(n: int, seed: int, hi: int = 40) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        d = rng.integers(10, 30_000, int(rng.integers(1, hi)), dtype=np.int64)
        d[0] = 11 + 2 * i  # unique, odd: a document is known by its first token
        if i % 4 == 1:
            d[int(rng.integers(0, len(d)))] = BAD
        docs.append(d)
    return docs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("transform") / "web"
    root.mkdir()
    docs = make_docs(30, 1)
    write_arrow_batches(str(root / "a.arrow"), docs[:17], dtype=np.uint32)
    write_arrow_batches(str(root / "b.arrow"), docs[17:], dtype=np.uint32)
    index = DatasetIndex.build(str(root))
    keyed = {(0, i): d for i, d in enumerate(docs[:17])}
    keyed.update({(1, i): d for i, d in enumerate(docs[17:])})
    return index, keyed


def reader(index, **kw) -> ShardReader:
    kw.setdefault("epochs", 1)
    kw.setdefault("block_docs", 4)
    return ShardReader(index, 3, seed=2, world=World(0, 1, 0, 1), **kw)


def delivered(blocks) -> dict:
    """Documents delivered by a block stream, pieces joined, by (file, doc)."""
    out: dict = {}
    for b in blocks:
        for doc in b:
            key = (doc.file, doc.doc)
            assert doc.start == len(out.get(key, [])), f"{key}: pieces out of order"
            out[key] = np.concatenate([out.get(key, np.zeros(0, np.int64)), doc.data])
    return out


def assert_same_docs(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].tolist() == want[k].tolist(), k


# -- the steps ---------------------------------------------------------------------------------
def block_of(docs: list[np.ndarray]) -> DocumentBlock:
    n = len(docs)
    return DocumentBlock.from_pieces("d", docs, [0] * n, list(range(n)), [0] * n, [True] * n)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=12), min_size=1, max_size=12),
    st.integers(0, 8),
    st.integers(1, 6),
)
def test_builtins_equal_their_per_document_definition(docs, lo, n) -> None:
    arrays = [np.asarray(d, np.int32) for d in docs]
    block = block_of(arrays)

    def per_doc(step_fn):
        kept = [(i, step_fn(d)) for i, d in enumerate(arrays)]
        return [(i, d.tolist()) for i, d in kept if d is not None]

    def got(step):
        out = step.apply(block)
        return list(zip(out.doc.tolist(), [d.data.tolist() for d in out]))

    assert got(length_filter(lo)) == per_doc(lambda d: d if len(d) >= lo else None)
    assert got(length_filter(None, lo)) == per_doc(lambda d: d if len(d) <= lo else None)
    assert got(drop_tokens([3, lo])) == per_doc(lambda d: None if {3, lo} & set(d.tolist()) else d)
    assert got(truncate(n)) == per_doc(lambda d: d[:n])
    assert got(Map(reverse_and_grow)) == per_doc(lambda d: reverse_and_grow(d, None))


def test_builtins_on_large_blocks_gather_the_same() -> None:
    """Blocks of many documents take the vectorised gather instead of slice copies."""
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 9, int(n), dtype=np.int32) for n in rng.integers(0, 20, 600)]
    block = block_of(docs)
    for step, ref in ((length_filter(8), ref_min(8)), (truncate(5), ref_trunc(5))):
        out = step.apply(block)
        want = [(i, d.tolist()) for i, d in enumerate(docs) if ref(d) is not None]
        assert [(i, ref(docs[i]).tolist()) for i, _ in want] == list(
            zip(out.doc.tolist(), [d.data.tolist() for d in out])
        )


def test_specs_build_the_builtins_and_bad_specs_name_the_key() -> None:
    block = block_of([np.arange(10, 10 + k, dtype=np.int32) for k in (1, 3, 5, 9)])
    assert from_spec({"min_length": 3, "max_length": 5}).apply(block).doc.tolist() == [1, 2]
    assert from_spec({"truncate": 2}).apply(block).lengths.tolist() == [1, 2, 2, 2]
    assert from_spec({"drop_tokens": 11}).apply(block).doc.tolist() == [0]
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['min_len'\]"):
        from_spec({"min_len": 3})
    with pytest.raises(ValueError, match="one built-in per entry"):
        from_spec({"truncate": 3, "drop_tokens": 1})
    with pytest.raises(ValueError, match="truncate=0 must be >= 1"):
        from_spec({"truncate": 0})
    with pytest.raises(TypeError, match="exactly one of fn"):
        Map()


def test_user_functions_cannot_write_into_the_block() -> None:
    def scribble(tokens, meta):
        tokens[0] = 0
        return tokens

    with pytest.raises(TransformError, match="read-only") as info:
        Map(scribble).apply(block_of([np.arange(3, dtype=np.int32)]))
    assert isinstance(info.value.__cause__, ValueError)


# -- the node on a real reader -----------------------------------------------------------------
@pytest.mark.parametrize(("chunk", "block_docs"), [(None, 4), (6, 4), (1, 3), (13, 1)])
def test_delivered_documents_equal_the_reference(data, chunk, block_docs) -> None:
    """Filter, map (length-changing) and built-ins: the delivered set is the reference set,
    also with documents cut into pieces by the reader (a filter drops all pieces)."""
    index, raw = data
    node = TransformDocuments(
        reader(index, max_chunksize=chunk, block_docs=block_docs),
        [Filter(no_bad), reverse_and_grow, {"min_length": 8}, {"truncate": 30}],
    )
    got = delivered(run(node))
    want = reference(raw, [ref_no_bad, ref_grow, ref_min(8), ref_trunc(30)])
    assert 5 < len(want) < len(raw)
    assert_same_docs(got, want)
    if chunk:  # documents cut by the reader come out cut into pieces of the reader's size
        node.reset()
        cut = [len(d.data) for b in run(node) for d in b if d.start or not d.last]
        assert cut and max(cut) == chunk


def test_block_fn_and_per_document_forms_agree(data) -> None:
    index, _ = data

    def keep_odd_length(block):
        return np.diff(block.offsets) % 2 == 1

    a = run(FilterDocuments(reader(index), block_fn=keep_odd_length))
    b = run(FilterDocuments(reader(index), lambda t, meta: len(t) % 2 == 1))
    assert_same_docs(delivered(a), delivered(b))


def test_nodes_stack_into_one(data) -> None:
    index, raw = data
    inner = FilterDocuments(reader(index), no_bad)
    outer = MapDocuments(inner, reverse_and_grow)
    assert outer.source is inner.source and len(outer.steps) == 2
    assert_same_docs(delivered(run(outer)), reference(raw, [ref_no_bad, ref_grow]))


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunked"])
def test_restore_at_every_step(data, chunk) -> None:
    index, _ = data

    def make():
        return TransformDocuments(
            reader(index, max_chunksize=chunk, block_docs=3, epochs=2),
            [Filter(no_bad), reverse_and_grow],
        )

    items = check_restore_at_every_step(make)
    assert len(items) > 10


def test_fetch_document_returns_the_transformed_document(data) -> None:
    index, raw = data
    node = TransformDocuments(reader(index), [reverse_and_grow])
    node.reset()
    for key, d in raw.items():
        want = reverse_and_grow(d, None)
        if want is None:
            with pytest.raises(ValueError, match="drop this document now"):
                node.fetch_document("web", *key)
        else:
            assert node.fetch_document("web", *key).tolist() == want.tolist()


def test_a_non_deterministic_function_is_refused(data) -> None:
    index, _ = data
    calls = iter(range(10**6))

    def counter(tokens, meta):  # differs on every call
        return tokens + next(calls)

    with pytest.raises(ValueError, match="'counter' gave different results .*deterministic"):
        run(MapDocuments(reader(index), counter))


def test_text_transforms(tmp_path) -> None:
    texts = [f"doc {i} " + "spam " * (i % 3) + "x" * i for i in range(12)]
    write_jsonl(str(tmp_path / "t" / "a.jsonl"), texts)
    index = DatasetIndex.build(str(tmp_path / "t"))

    def no_spam(text, meta):
        return "spam" not in text

    def upper(text, meta):
        return text.upper()

    node = TransformDocuments(reader(index), [Filter(no_spam, on="text"), Map(upper, on="text")])
    got = {(d.file, d.doc): d.data for b in run(node) for d in b}
    assert got == {(0, i): t.upper() for i, t in enumerate(texts) if "spam" not in t}
    check_restore_at_every_step(
        lambda: TransformDocuments(
            reader(index, block_docs=2, epochs=2),
            [Filter(no_spam, on="text"), Map(upper, on="text")],
        )
    )
    with pytest.raises(ValueError, match="mix text and token steps"):
        TransformDocuments(reader(index), [Filter(no_spam, on="text"), {"min_length": 2}])


# -- the pipeline: config hooks, restore, rescale ----------------------------------------------
@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("transform_pipe")
    for name, n, seed in (("web", 120, 3), ("code", 60, 4)):
        docs = make_docs(n, seed, hi=50)
        for f in range(2):
            write_arrow_batches(str(root / name / f"p{f}.arrow"), docs[f::2], dtype=np.uint32)
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="2,1", seq_length=32, eos_token=0,
        bos_token=1, logical_shards=24, batch_size=2, seed=5, shuffle_buffer=6, block_docs=5,
        epochs=1, mix_quantum_tokens=0, max_chunksize=12,
        transforms={"*": [Filter(no_bad)], "web": [reverse_and_grow, {"truncate": 40}]},
    )  # fmt: skip


def mapped_reference(cfg: PipelineConfig) -> dict:
    """(dataset, file, doc) -> the document after the config's transforms, from raw files."""
    from torchdata_ext.pipeline.build import build_datasets

    out = {}
    for name, index in build_datasets(cfg).items():
        h = index.handler()
        raw = {}
        for f, url in enumerate(index.files):
            r = h.open(url)
            for d in range(int(index.doc_counts[f])):
                raw[(name, f, d)] = np.asarray(h.get(r, d), np.int64)
        steps = [ref_no_bad] + ([ref_grow, ref_trunc(40)] if name == "web" else [])
        out.update(reference(raw, steps))
    return out


def check_sequences(seqs, names, want: dict, coverage: dict) -> None:
    """Every document token of every sequence is the transformed document's token its
    provenance names; adds the ranges to ``coverage``."""
    for seq in seqs:
        prov = np.asarray(seq["provenance"])
        x = np.concatenate([seq["input_ids"], seq["labels"][-1:]])
        at = 0
        for ds, f, d, start, length in prov.tolist():
            if ds not in (LITERAL, PAD):
                key = (names[ds], f, d)
                assert x[at : at + length].tolist() == want[key][start : start + length].tolist()
                coverage.setdefault(key, []).append((start, start + length))
            at += length


def test_pipeline_restore_at_every_step_rebuilds_the_shuffle_buffer(cfg) -> None:
    """The shuffle buffer rebuilds its sequences through fetch_document: the mapped documents."""
    want = mapped_reference(cfg)
    items = check_restore_at_every_step(
        lambda: build_pipeline(cfg, World(0, 1, 0, 1), collate=False), max_steps=25
    )
    coverage: dict = {}
    check_sequences(items, ["web", "code"], want, coverage)
    assert coverage


def build(cfg, world):
    return build_pipeline(cfg, world, collate=False)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("old", "new"), [((2, 2), (3, 1)), ((1, 0), (2, 0))], ids=str)
def test_rescale_with_a_length_changing_map_and_a_filter(cfg, tmp_path, old, new) -> None:
    """Save at R x W, restore at R' x W' and finish the epoch: every token of every kept,
    mapped document exactly once, each the right token."""
    from torchdata_ext.checkpoint import load_checkpoint, save_checkpoint
    from torchdata_ext.loader.token_loader import TokenLoader
    from torchdata_ext.state.graph import reader_states as _reader_states

    want = mapped_reference(cfg)
    names = ["web", "code"]
    coverage: dict = {}
    ckpt = str(tmp_path / "ckpt")
    R, W = old
    for r in range(R):
        loader = TokenLoader(functools.partial(build, cfg), num_workers=W, rank=r, world_size=R)
        seqs = []
        for seq in loader:
            seqs.append(seq)
            if len(seqs) >= 7 + 2 * r:
                break
        check_sequences(seqs, names, want, coverage)
        save_checkpoint(loader, ckpt)
    returned = []
    R2, W2 = new
    for r in range(R2):
        loader = TokenLoader(functools.partial(build, cfg), num_workers=W2, rank=r, world_size=R2)
        load_checkpoint(loader, ckpt)
        for st_ in loader.state_dict()["workers"].values():
            for rd in _reader_states(st_).values():
                for extras in reader_cursors(rd).extras.values():
                    returned.extend(extras.get("returned", []))
        check_sequences(list(loader), names, want, coverage)
    check_exactly_once(coverage, {k: len(v) for k, v in want.items()})
    assert returned, "nothing was in flight: the test would not test the hand-back"


def test_yaml_config_uses_the_builtins(tmp_path, cfg) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        f"data_path: {cfg.data_path}\ndatasets: web,code\nseq_length: 32\nlogical_shards: 4\n"
        "epochs: 1\nshuffle_buffer: 1\ntransforms:\n  - min_length: 20\n  - drop_tokens: [7]\n"
    )
    loaded = PipelineConfig.from_file(str(path))
    assert [s.name for s in loaded.transforms_for("web")] == [
        "length_filter(20, None)",
        "drop_tokens([7])",
    ]
    seqs = list(build_pipeline(loaded, World(0, 1, 0, 1), collate=False))
    lengths = {}
    for seq in seqs:
        for ds, f, d, start, length in np.asarray(seq["provenance"]).tolist():
            if ds >= 0:
                lengths[(ds, f, d)] = max(lengths.get((ds, f, d), 0), start + length)
    assert lengths and min(lengths.values()) >= 20
    with pytest.raises(ValueError, match=r"transforms names datasets \['wbe'\]"):
        PipelineConfig(data_path="x", datasets="web", transforms={"wbe": [{"truncate": 3}]})
    with pytest.raises(ValueError, match="unknown key"):
        PipelineConfig(data_path="x", transforms=[{"min": 3}])
    with pytest.raises(ValueError, match="drop_remainder=True is for pack_mode='chunk' only"):
        PipelineConfig(data_path="x", drop_remainder=True)


def test_no_transform_node_without_transforms(cfg) -> None:
    import dataclasses

    from torchdata_ext.state.graph import graph_nodes

    plain = dataclasses.replace(cfg, transforms=[])
    nodes = graph_nodes(build_pipeline(plain, World(0, 1, 0, 1)))
    assert not any(isinstance(n, TransformDocuments) for n in nodes)
    nodes = graph_nodes(build_pipeline(cfg, World(0, 1, 0, 1)))
    assert sum(isinstance(n, TransformDocuments) for n in nodes) == 2


def no_spam(text: str, meta) -> bool:
    return "spam" not in text


def shout(text: str, meta) -> str:
    return text.upper() + "!"


@pytest.fixture(scope="module")
def text_cfg(tmp_path_factory) -> PipelineConfig:
    root = str(tmp_path_factory.mktemp("transform_text"))
    words = ["data", "loader", "spam", "token", "shard", "rescale"]
    write_random_text_datasets(root, [("web", 80, 6), ("code", 40, 6)], words, seed=11)
    return text_config(
        root,
        transforms=[Filter(no_spam, on="text"), shout, Map(reverse_and_grow), {"min_length": 14},
                    {"truncate": 50}],
    )  # fmt: skip


def text_reference(cfg: PipelineConfig) -> dict:
    from torchdata_ext.pipeline.build import build_datasets
    from torchdata_ext.tokenizers.load import ByteTokenizer

    out = {}
    for name, index in build_datasets(cfg).items():
        h = index.handler()
        for f, url in enumerate(index.files):
            r = h.open(url)
            for d in range(int(index.doc_counts[f])):
                text = h.get(r, d)
                if "spam" in text:
                    continue
                tokens = ByteTokenizer().encode(shout(text, None)).astype(np.int64)
                x = reverse_and_grow(tokens, None)
                if x is not None and len(x) >= 14:
                    out[(name, f, d)] = x[:50]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("old", "new"), [((2, 0), (1, 0)), ((1, 2), (3, 1))], ids=str)
def test_text_and_token_transforms_rescale(text_cfg, tmp_path, old, new) -> None:
    """Text steps before tokenize, token steps after it: handed-back pieces are token ranges
    of the transformed document, cut by the token transform node (tokenize hands the whole
    encoded text on)."""
    from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
    from torchdata_ext.loader.token_loader import TokenLoader

    want = text_reference(text_cfg)
    names = ["web", "code"]
    coverage: dict = {}
    ckpt = str(tmp_path / "ckpt")
    R, W = old
    for r in range(R):
        loader = TokenLoader(
            functools.partial(build, text_cfg), num_workers=W, rank=r, world_size=R
        )
        seqs = []
        for seq in loader:
            seqs.append(seq)
            if len(seqs) >= 5 + r:
                break
        check_sequences(seqs, names, want, coverage)
        save_checkpoint(loader, ckpt)
    R2, W2 = new
    for r in range(R2):
        loader = TokenLoader(
            functools.partial(build, text_cfg), num_workers=W2, rank=r, world_size=R2
        )
        load_checkpoint(loader, ckpt)
        check_sequences(list(loader), names, want, coverage)
    check_exactly_once(coverage, {k: len(v) for k, v in want.items()})


def test_interleave_counts_the_transformed_tokens(cfg) -> None:
    """Interleave's token shares see the documents as transformed: after the epoch its
    counters are the transformed documents' tokens, dataset by dataset."""
    from torchdata_ext.nodes.interleave import Interleave
    from torchdata_ext.state.graph import graph_nodes

    node = build_pipeline(cfg, World(0, 1, 0, 1), collate=False)
    node.reset()
    for _ in node:
        pass
    (mix,) = [n for n in graph_nodes(node) if isinstance(n, Interleave)]
    counters = mix.state_dict()["tokens_delivered"]  # its own, not the packer's replay point
    want = mapped_reference(cfg)
    for name in ("web", "code"):
        assert counters[name] == sum(len(v) for k, v in want.items() if k[0] == name)
