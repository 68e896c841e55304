"""Packing: how many documents get split, how much padding, and tokens/s, concat vs best_fit.

Document lengths are lognormal (median ~600 tokens, clipped to 16 .. 100,000), seeded. The same
documents go, as in-memory ``DocumentBlock`` s, through ``Pack`` in ``concat`` and ``best_fit``
mode (and ``pad`` for comparison) with ``seq_len`` 4096 and Bamba's ``eos_token = 0``. For each
mode it prints the fraction of documents split across sequences (of all documents, and of those
that fit in one sequence), the padding fraction of the output, and tokens/s against a reference
measured in the same run: ``np.concatenate`` of the same blocks (the least any packer does).

    python benchmarks/packing_split.py [--tokens 20_000_000] [--window 1000]
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext.document import DocumentBlock
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.provenance import PAD


class BlockSource(BaseNode[DocumentBlock]):
    """Pre-built blocks from memory; the state is the next block's index."""

    def __init__(self, blocks: list[DocumentBlock]) -> None:
        super().__init__()
        self.blocks = blocks
        self.i = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.i = 0 if initial_state is None else int(initial_state["i"])

    def next(self) -> DocumentBlock:
        if self.i >= len(self.blocks):
            raise StopIteration
        self.i += 1
        return self.blocks[self.i - 1]

    def get_state(self) -> dict[str, Any]:
        return {"i": self.i}


def make_blocks(total: int, block_docs: int, seed: int) -> tuple[list[DocumentBlock], np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        chunk = np.clip(rng.lognormal(np.log(600), 1.3, 4096), 16, 100_000).astype(np.int64)
        lengths.extend(chunk.tolist())
    lens = np.asarray(lengths[: int(np.searchsorted(np.cumsum(lengths), total)) + 1])
    flat = rng.integers(1, 128_000, size=int(lens.sum()), dtype=np.int32)
    bounds = np.concatenate([[0], np.cumsum(lens)])
    blocks = []
    for lo in range(0, len(lens), block_docs):
        hi = min(len(lens), lo + block_docs)
        off = bounds[lo : hi + 1] - bounds[lo]
        n = hi - lo
        blocks.append(
            DocumentBlock(
                "bench",
                flat[bounds[lo] : bounds[hi]],
                None,
                off.astype(np.int64),
                np.zeros(n, np.int32),
                np.arange(lo, hi, dtype=np.int64),
                np.zeros(n, np.int64),
                np.ones(n, bool),
            )
        )
    return blocks, lens


def reference(blocks: list[DocumentBlock]) -> float:
    t0 = time.perf_counter()
    out = np.concatenate([b.tokens for b in blocks])
    dt = time.perf_counter() - t0
    assert len(out) == sum(b.num_tokens for b in blocks)
    return dt


def pack_pass(blocks: list[DocumentBlock], mode: str, seq_len: int, window: int):
    pack = Pack(BlockSource(blocks), seq_len, mode=mode, eos_token=0, window=window)  # type: ignore[arg-type]
    provs = []
    t0 = time.perf_counter()
    for seq in pack:
        provs.append(seq["provenance"])
    return time.perf_counter() - t0, provs


def stats(provs: list[np.ndarray], lens: np.ndarray, seq_len: int) -> tuple[float, float, float]:
    seqs_of_doc: dict[int, set[int]] = collections.defaultdict(set)
    pad = 0
    for i, prov in enumerate(provs):
        data = prov[prov[:, 0] >= 0]
        for d in data[:, 2].tolist():
            seqs_of_doc[d].add(i)
        pad += int(prov[prov[:, 0] == PAD, 4].sum())
    split = np.array([len(seqs_of_doc[d]) > 1 for d in range(len(lens))])
    fits = lens + 1 <= seq_len  # with its EOS
    return float(split.mean()), float(split[fits].mean()), pad / (len(provs) * seq_len)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=20_000_000)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--window", type=int, default=1000)
    p.add_argument("--block-docs", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    blocks, lens = make_blocks(args.tokens, args.block_docs, args.seed)
    total = int(lens.sum())
    print(
        f"{len(lens):,} documents, {total:,} tokens, median length {int(np.median(lens))}, "
        f"max {int(lens.max()):,}, {int((lens + 1 > args.seq_len).sum()):,} longer than a "
        f"sequence; seq_len {args.seq_len}, best_fit window {args.window}"
    )
    ref = min(reference(blocks) for _ in range(args.repeats))
    print(f"{'reference np.concatenate':26s} {total / ref / 1e6:10.1f} M tokens/s")
    for mode in ("concat", "best_fit", "pad"):
        runs = [pack_pass(blocks, mode, args.seq_len, args.window) for _ in range(args.repeats)]
        dt = min(r[0] for r in runs)
        split, split_fit, pad = stats(runs[0][1], lens, args.seq_len)
        print(
            f"{mode:26s} {total / dt / 1e6:10.1f} M tokens/s  ({ref / dt:.3f} x reference)  "
            f"split {split:6.2%} of documents ({split_fit:6.2%} of those that fit)  "
            f"padding {pad:6.2%}  sequences {len(runs[0][1]):,}"
        )


if __name__ == "__main__":
    main()
