"""Document boundaries for variable-length attention (issue 32): ``seq_lens``, ``cu_seqlens``,
``max_seqlen``, emitted from the runs Pack laid out (never found by scanning for the EOS id).

Attention masked by them equals attention computed on each document alone; they are the same
on every path a batch takes (in process, through the compact packed batch, from dicts, through
a dataloader worker) and exact at every step of a save and restore. The rescale oracle
(``test_rescale_rows.py``) checks them against the rows' provenance.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import check_restore_at_every_step, run
from torchdata.nodes import IterableWrapper

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.audit.row_check import boundary_problems
from torchdata_ext.batch import BOUNDARY_KEYS
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.nodes.collate import Collate
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.nodes.shuffle import ShuffleBuffer
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.testing import write_arrow_batches

EOS, BOS = 0, 1
KEYS = ("input_ids", "labels", "position_ids", "document_ids", "provenance", *BOUNDARY_KEYS)
# doc c holds the EOS id mid-text: a boundary found by scanning for EOS would cut it in two
DOCS = [
    np.arange(10, 15),
    np.arange(20, 23),
    np.array([30, 31, EOS, 32, 33, 34, 35, 36, 37, 38, 39, 40]),
    np.arange(50, 52),
]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> DatasetIndex:
    root = tmp_path_factory.mktemp("varlen_small") / "web"
    root.mkdir()
    write_arrow_batches(str(root / "a.arrow"), [d.astype(np.uint32) for d in DOCS])
    return DatasetIndex.build(str(root))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> DatasetIndex:
    """Random documents over a small vocabulary, many holding the EOS id mid-text."""
    root = tmp_path_factory.mktemp("varlen") / "web"
    root.mkdir()
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, 40, size=int(n), dtype=np.uint32) for n in rng.integers(1, 30, 40)]
    assert sum(int((d[:-1] == EOS).sum()) for d in docs) > 10
    write_arrow_batches(str(root / "a.arrow"), docs[:20])
    write_arrow_batches(str(root / "b.arrow"), docs[20:])
    return DatasetIndex.build(str(root))


def _pack(index: DatasetIndex, seq_len: int = 24, shards: int = 4, **kw) -> Pack:
    chunk = kw.pop("chunk", None)
    reader = ShardReader(index, shards, world=World(), epochs=1, block_docs=3, max_chunksize=chunk)
    return Pack(reader, seq_len, eos_token=EOS, bos_token=BOS, **kw)


def test_boundaries_are_the_packed_runs_not_the_eos_ids(small) -> None:
    node = Collate(_pack(small, 8, shards=1), 4, keys=("input_ids", *BOUNDARY_KEYS))
    (batch,) = run(node)
    assert batch["input_ids"].tolist() == [
        [BOS, 20, 21, 22, EOS, BOS, 30, 31],
        [EOS, 32, 33, 34, 35, 36, 37, 38],  # doc c goes on: its EOS id is text, not a boundary
        [39, 40, EOS, BOS, 50, 51, EOS, BOS],
        [10, 11, 12, 13, 14, EOS, 0, 0],  # then padding (token 0 too): a segment of its own
    ]
    assert batch["seq_lens"].tolist() == [[5, 3, 0], [8, 0, 0], [3, 4, 1], [6, 2, 0]]
    assert batch["cu_seqlens"].tolist() == [0, 5, 8, 16, 19, 23, 24, 30, 32]
    assert int(batch["max_seqlen"]) == 8
    assert [batch[k].dtype for k in BOUNDARY_KEYS] == [torch.int32] * 3
    assert batch["max_seqlen"].shape == ()


def test_with_shift_and_line_specials_the_boundaries_are_those_of_the_inputs(small) -> None:
    pack = _pack(small, 8, shards=1, shift=True, bol_token=2, eol_token=3, mode="pad")
    batch, last = run(Collate(pack, 4, keys=("input_ids", "labels", *BOUNDARY_KEYS)))
    assert batch["input_ids"].tolist() == [
        [2, BOS, 20, 21, 22, EOS, 0, 0],  # bol, doc b, padding (its eol is the last label)
        [2, BOS, 30, 31, EOS, 32, 33, 34],  # doc c is longer than a row: split
        [2, 35, 36, 37, 38, 39, 40, EOS],
        [2, BOS, 50, 51, EOS, 0, 0, 0],
    ]
    assert batch["seq_lens"].tolist() == [[1, 5, 2], [1, 7, 0], [1, 7, 0], [1, 4, 3]]
    assert batch["cu_seqlens"].tolist() == [0, 1, 6, 8, 9, 16, 17, 24, 25, 29, 32]
    assert int(batch["max_seqlen"]) == 7
    assert last["input_ids"].tolist() == [[2, BOS, 10, 11, 12, 13, 14, EOS]]
    assert last["seq_lens"].tolist() == [[1, 7]] and last["cu_seqlens"].tolist() == [0, 1, 8]


def _segments(cu: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Each token's segment number (flat over the batch), from ``cu_seqlens``."""
    return torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(cu)).reshape(shape)


def _document_causal(seg: torch.Tensor):
    """flex_attention's mask_mod: a query sees the keys of its own segment, up to itself."""

    def mask_mod(b, h, q, k):
        return (seg[b, q] == seg[b, k]) & (q >= k)

    return mask_mod


def _qkv(tokens: torch.Tensor, heads: int = 2, dim: int = 8):
    """Queries, keys and values ``[B, H, L, D]`` that depend on the tokens and positions."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(3, 64, heads, dim, generator=gen, dtype=torch.float64)
    return [table[i][tokens.long() % 64].transpose(1, 2) for i in range(3)]


@pytest.mark.parametrize(
    "kw", [{}, {"mode": "best_fit", "window": 6, "shift": True}, {"mode": "pad", "chunk": 7}]
)
def test_flex_attention_with_the_document_mask_is_attention_per_document(corpus, kw) -> None:
    """flex_attention (CPU) with a mask built from ``cu_seqlens`` equals causal attention run
    on each document's tokens alone, on real packed batches with EOS ids inside documents."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batches = run(Collate(_pack(corpus, **kw), 4, keys=KEYS), max_steps=3)
    cut_inside = 0
    for batch in batches:
        x = batch["input_ids"]
        B, L = x.shape
        cu = batch["cu_seqlens"]
        seg = _segments(cu, (B, L))
        q, k, v = _qkv(x)
        mask = create_block_mask(_document_causal(seg), B, None, L, L, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex_attention runs unfused on the CPU
            got = flex_attention(q, k, v, block_mask=mask)
        want = torch.empty_like(q)
        flat = [t.transpose(1, 2).reshape(B * L, *t.shape[1::2]) for t in (q, k, v)]
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            one = [t[a:b].transpose(0, 1) for t in flat]  # [H, n, D]: this segment alone
            out = F.scaled_dot_product_attention(*one, is_causal=True)
            want.transpose(1, 2).reshape(B * L, *q.shape[1::2])[a:b] = out.transpose(0, 1)
        assert torch.allclose(got, want, atol=1e-12)
        # the segments are the document runs: a document's tokens share one segment ...
        docs = batch["document_ids"]
        for b in range(B):
            for d in set(docs[b].tolist()) - {-1}:
                assert len(set(seg[b][docs[b] == d].tolist())) == 1
        # ... whatever EOS ids they hold (scanning for EOS would have cut there)
        inside = (x == EOS) & (batch["position_ids"] > 0)
        inside[:, :-1] &= batch["position_ids"][:, 1:] > 0
        cut_inside += int(inside.sum())
    assert cut_inside > 0


@pytest.mark.parametrize(
    "kw", [{}, {"mode": "best_fit", "window": 5, "shift": True}, {"mode": "chunk", "chunk": 9}]
)
def test_every_path_gives_the_same_boundaries(corpus, kw) -> None:
    """In process, the compact packed batch (what a worker sends), dicts from a source
    without the packed protocol, and the provenance check all agree."""
    fused = run(Collate(_pack(corpus, **kw), 3, keys=KEYS))
    node = Collate(_pack(corpus, **kw), 3, keys=KEYS)
    node.reset()
    compact = [node.next_packed_batch().to_tensors() for _ in range(len(fused))]
    dicts = run(Collate(IterableWrapper(run(_pack(corpus, **kw))), 3, keys=KEYS))
    for one, two, three in zip(fused, compact, dicts, strict=True):
        assert list(one) == list(two) == list(three) == [k for k in KEYS if k in one]
        assert ("labels" in one) == ("shift" in kw) and "provenance" in one
        for key in BOUNDARY_KEYS:
            assert torch.equal(one[key], two[key]) and torch.equal(one[key], three[key]), key
        for r in range(len(one["input_ids"])):
            prov = one["provenance"][r].numpy()
            prov = prov[prov[:, 4] > 0]
            assert not boundary_problems(f"row {r}", prov, ["web"], one["seq_lens"][r].numpy(), 24)


def test_boundaries_are_exact_at_every_step_of_a_restore(corpus) -> None:
    def make() -> Collate:
        pack = _pack(corpus, mode="best_fit", window=6, shift=True)
        return Collate(ShuffleBuffer(pack, 4, seed=1), 3, keys=("input_ids", *BOUNDARY_KEYS))

    batches = check_restore_at_every_step(make)
    assert len(batches) > 5 and all(set(b) == {"input_ids", *BOUNDARY_KEYS} for b in batches)


def test_boundary_problems_names_a_wrong_cut(small) -> None:
    (batch,) = run(Collate(_pack(small, 8, shards=1), 4, keys=("provenance", "seq_lens")))
    prov, names = batch["provenance"][1].numpy(), ["web"]
    assert boundary_problems("row 1", prov, names, np.array([8, 0, 0]), 8) == []
    (msg,) = boundary_problems("row 1", prov, names, np.array([2, 6, 0]), 8)
    assert msg.startswith("row 1: token 2 (") and "needs no cut" in msg
    (msg,) = boundary_problems("row 1", prov, names, np.array([7, 0]), 8)
    assert "do not tile the row's 8 tokens" in msg
    short = prov[prov[:, 4] > 0]  # without Collate's rows of length 0
    short[-1, 4] -= 1  # a row the provenance does not cover
    (msg,) = boundary_problems("row 1", short, names, np.array([8, 0, 0]), 8)
    assert msg == "row 1: the provenance covers 7 tokens, not the row's 8"


def test_a_source_of_dicts_without_position_ids_is_refused() -> None:
    items = [{"input_ids": np.arange(4)}, {"input_ids": np.arange(4)}]
    node = Collate(IterableWrapper(items), 2, keys=("input_ids", "cu_seqlens"))
    node.reset()
    with pytest.raises(KeyError, match="reads from each item's 'position_ids'"):
        next(node)


def test_the_pipeline_delivers_them_through_workers(tmp_path: Path) -> None:
    """``output_keys`` asks for them; a dataloader worker sends the compact batch and the
    training process builds them, equal to the in-process pipeline's."""
    rng = np.random.default_rng(2)
    docs = [rng.integers(2, 500, size=int(n), dtype=np.uint32) for n in rng.integers(1, 60, 30)]
    write_arrow_batches(str(tmp_path / "web" / "a.arrow"), docs)
    cfg = PipelineConfig(
        data_path=str(tmp_path), datasets="web", seq_length=32, batch_size=2, eos_token=0,
        bos_token=1, logical_shards=4, epochs=1, shuffle_buffer=3,
        output_keys="input_ids,labels,seq_lens,cu_seqlens,max_seqlen",
    )  # fmt: skip
    want = run(build_pipeline(cfg, World()))
    loader = TokenLoader(lambda w: build_pipeline(cfg, w), num_workers=1)
    got = list(loader)
    assert len(got) == len(want) > 3
    for a, b in zip(got, want, strict=True):
        assert list(a) == ["input_ids", "labels", "seq_lens", "cu_seqlens", "max_seqlen"]
        for key in a:
            assert torch.equal(a[key], b[key]), key
        assert int(a["cu_seqlens"][-1]) == a["input_ids"].numel()
