"""Pack's ``chunk`` mode: every document cut into sequences of its own (epochraft ``chunk``).

The exact sequences are checked against a per-document reference; restores at every step and
rescales give exactly the sequences of the uninterrupted run.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import numpy as np
import pytest
from harness import (
    check_exactly_once,
    check_restore_at_every_step,
    run,
    write_random_arrow_datasets,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pack import ListSource

from torchdata_ext import World
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.nodes.reader import ShardReader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.sources.index import DatasetIndex
from torchdata_ext.testing import write_arrow_batches

BOS, EOS, BOL, EOL, P = 1, 2, 3, 4, 5


def reference_chunks(docs, seq_len, *, bos, eos, bol, eol, drop_remainder, shift=False):
    """The input_ids ``chunk`` mode gives: each document with its BOS/EOS cut every capacity
    tokens, its last piece padded (or dropped), each sequence between bol and eol; a piece of
    only the BOS or the EOS is left out."""
    packed = seq_len + int(shift)
    cap = packed - (bol is not None) - (eol is not None)
    out = []
    for d in docs:
        unit = ([bos] if bos is not None else []) + list(d) + ([eos] if eos is not None else [])
        lo = int(bos is not None)  # document tokens are unit[lo : lo + len(d)]
        for a in range(0, len(unit), cap):
            piece = unit[a : a + cap]
            if a + len(piece) <= lo or a >= lo + len(d):
                continue  # only a BOS or an EOS: never a sequence
            if len(piece) < cap:
                if drop_remainder:
                    continue
                piece = piece + [P] * (cap - len(piece))
            line = ([bol] if bol is not None else []) + piece + ([eol] if eol is not None else [])
            out.append(line[:seq_len])
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=8),
    st.integers(3, 12),
    st.sampled_from([None, 2, 5]),
    st.integers(1, 4),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_sequences_equal_the_reference(lengths, seq_len, chunk, block_docs, drop, specials, bl):
    docs = [np.arange(100 * (i + 1), 100 * (i + 1) + n) for i, n in enumerate(lengths)]
    kw = {
        "bos_token": BOS if specials else None,
        "eos_token": EOS if specials else None,
        "bol_token": BOL if bl else None,
        "eol_token": EOL if bl else None,
    }
    pack = Pack(
        ListSource(docs, block_docs=block_docs, max_chunksize=chunk),
        seq_len,
        mode="chunk",
        pad_token=P,
        drop_remainder=drop,
        **kw,
    )
    got = [s["input_ids"].tolist() for s in run(pack)]
    ref = reference_chunks(
        docs, seq_len, bos=kw["bos_token"], eos=kw["eos_token"], bol=kw["bol_token"],
        eol=kw["eol_token"], drop_remainder=drop,
    )  # fmt: skip
    assert got == ref
    for s in run(Pack(ListSource(docs, block_docs, chunk), seq_len, mode="chunk", pad_token=P)):
        assert set(s["document_ids"].tolist()) <= {-1, 0}, "two documents in one sequence"


def test_module_example() -> None:
    # chunk.py's docstring: a document of 8 tokens and one of 2, capacity 4
    a, b = np.arange(10, 18), np.arange(20, 22)
    kw = {"bos_token": BOS, "eos_token": EOS, "pad_token": P}
    seqs = run(Pack(ListSource([a, b]), 4, mode="chunk", **kw))
    assert [s["input_ids"].tolist() for s in seqs] == [
        [BOS, 10, 11, 12],
        [13, 14, 15, 16],
        [17, EOS, P, P],
        [BOS, 20, 21, EOS],
    ]
    assert seqs[2]["loss_mask"].tolist() == [True, True, False, False]
    dropped = run(Pack(ListSource([a, b]), 4, mode="chunk", drop_remainder=True, **kw))
    assert [s["input_ids"].tolist() for s in dropped] == [
        [BOS, 10, 11, 12],
        [13, 14, 15, 16],
        [BOS, 20, 21, EOS],
    ]


def test_drop_remainder_is_for_chunk_mode_only() -> None:
    with pytest.raises(ValueError, match="drop_remainder=True is for mode='chunk' only"):
        Pack(ListSource([np.arange(3)]), 4, mode="concat", drop_remainder=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk") / "web"
    root.mkdir()
    rng = np.random.default_rng(2)
    docs = [rng.integers(10, 1000, int(rng.integers(1, 30))) for _ in range(14)]
    write_arrow_batches(str(root / "a.arrow"), docs[:9], dtype=np.uint32)
    write_arrow_batches(str(root / "b.arrow"), docs[9:], dtype=np.uint32)
    return DatasetIndex.build(str(root))


@pytest.mark.parametrize("drop", [False, True], ids=["pad", "drop"])
@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunked"])
def test_restore_at_every_step(tiny, drop, chunk) -> None:
    def make():
        reader = ShardReader(
            tiny, 2, seed=1, world=World(0, 1, 0, 1), epochs=2, block_docs=3, max_chunksize=chunk
        )
        return Pack(reader, 8, mode="chunk", bos_token=BOS, eos_token=EOS, drop_remainder=drop)

    items = check_restore_at_every_step(make)
    assert len(items) > 10


# -- rescale -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> PipelineConfig:
    root = tmp_path_factory.mktemp("chunk_rescale")
    write_random_arrow_datasets(str(root), (("web", 100, 20), ("code", 50, 45)), seed=3)
    return PipelineConfig(
        data_path=str(root), datasets="web,code", weights="2,1", seq_length=16, eos_token=0,
        bos_token=1, logical_shards=24, batch_size=2, seed=5, shuffle_buffer=6, block_docs=5,
        epochs=1, mix_quantum_tokens=0, max_chunksize=24, pack_mode="chunk",
    )  # fmt: skip


def build(cfg, world):
    return build_pipeline(cfg, world, collate=False)


def seq_key(seq) -> tuple:
    return tuple(seq["input_ids"].tolist()) + (int(seq["labels"][-1]),)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("drop", [False, True], ids=["pad", "drop"])
def test_rescale_2x2_to_3x1_gives_the_same_sequences(cfg, tmp_path, drop) -> None:
    """The sequences delivered before and after the rescale are exactly those of an
    uninterrupted run (chunks stay aligned to their document's start), each from one document;
    without drop_remainder every token is delivered once."""
    from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
    from torchdata_ext.loader.token_loader import TokenLoader

    cfg = dataclasses.replace(cfg, drop_remainder=drop)
    ref = collections.Counter(seq_key(s) for s in build(cfg, World(0, 1, 0, 1)))
    got: collections.Counter = collections.Counter()
    coverage: dict = {}
    ckpt = str(tmp_path / "ckpt")

    def take(seqs):
        for seq in seqs:
            got[seq_key(seq)] += 1
            docs = set()
            for ds, f, d, start, length in np.asarray(seq["provenance"]).tolist():
                if ds not in (LITERAL, PAD):
                    docs.add((ds, f, d))
                    coverage.setdefault((ds, f, d), []).append((start, start + length))
            assert len(docs) <= 1, f"a sequence holds documents {docs}"

    for r in range(2):
        loader = TokenLoader(functools.partial(build, cfg), num_workers=2, rank=r, world_size=2)
        seqs = []
        for seq in loader:
            seqs.append(seq)
            if len(seqs) >= 7 + 2 * r:
                break
        take(seqs)
        save_checkpoint(loader, ckpt)
    for r in range(3):
        loader = TokenLoader(functools.partial(build, cfg), num_workers=1, rank=r, world_size=3)
        load_checkpoint(loader, ckpt)
        take(list(loader))
    assert got == ref
    if not drop:
        lengths = {}
        for k, v in coverage.items():
            lengths[k] = max(b for _, b in v)
        check_exactly_once(coverage, lengths)
