"""The mix a user sees: each dataset's share of the tokens of batches 1-N, old and new default.

Two corpora, each run with the old default ``mix_quantum_tokens=65536`` and with the current
default (``None``: one sequence, ``seq_length`` tokens), in the same run (the long-document
corpus also with documents kept whole, as the mix was before it switched datasets at row ends
inside a document, and with ``shuffle_fill="full"``, whose buffer mixes 10,000 rows before
the first batch):

* **long document**: ``code`` (1.3M tokens in ~1,300 documents, median 600, and one of 690,000 tokens) and
  ``prose`` (lognormal lengths, median 600, 4M tokens) at weights 1 : 2, otherwise the
  default config (seq 4,096 + 1, batch 8, a 10,000-row shuffle buffer, streaming fill);
* **quick start**: the README's text config (``web``, ``code`` at 3 : 1, byte tokenizer, seq
  128, batch 4, a 100-row buffer) on short documents.

Token ids tell the datasets apart (each dataset writes ids from its own range; the long
document its own), so the share of a window is counted on the delivered ``input_ids``
(document tokens only: EOS and padding are left out). Prints, per corpus and setting, each
dataset's share over batches 1-N, the first batch that holds the long document, and the
pipeline's tokens/s (rough: one run, a shared machine).

    python benchmarks/mix_share.py [--batches 1000] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _corpus import lognormal_lengths  # noqa: E402

from torchdata_ext import PipelineConfig, build_pipeline  # noqa: E402
from torchdata_ext.nodes.interleave import Interleave  # noqa: E402
from torchdata_ext.sources.index import DatasetIndex  # noqa: E402

OLD_DEFAULT = 65_536
LONG = 690_000
# token id ranges: (first, last + 1) of each dataset's ordinary documents; the long one apart
RANGES = {"code": (10_000, 20_000), "prose": (30_000, 40_000), "long": (50_000, 50_001)}


@contextlib.contextmanager
def whole_documents(on: bool):
    """With ``on``, the mix as it was before row cuts: Pack gives it no rows to follow, so
    it never switches datasets inside a document."""
    follow = Interleave.follow_rows
    if on:
        Interleave.follow_rows = lambda self, mirror, capacity: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Interleave.follow_rows = follow  # type: ignore[method-assign]


def long_document_corpus(seed: int) -> dict[str, DatasetIndex]:
    """``code`` (1.3M tokens of short documents and one of ``LONG`` tokens), ``prose`` (4M)."""
    rng = np.random.default_rng(seed)

    def docs(total: int, lo: int, hi: int) -> list[np.ndarray]:
        return [rng.integers(lo, hi, n, dtype=np.int64) for n in lognormal_lengths(total, rng)]

    code = docs(1_300_000, *RANGES["code"])  # >= 1,024 documents (one per logical shard)
    code.insert(int(rng.integers(0, len(code))), np.full(LONG, RANGES["long"][0], np.int64))
    return {
        "code": DatasetIndex.from_documents("code", code),
        "prose": DatasetIndex.from_documents("prose", docs(4_000_000, *RANGES["prose"])),
    }


def shares(cfg: PipelineConfig, datasets: dict[str, DatasetIndex], batches: int,
           windows: list[int], groups: dict[str, list[str]]) -> dict[str, Any]:  # fmt: skip
    """Each group's share of the document tokens of batches 1..w for every ``w`` in
    ``windows``, the first batch holding a ``long`` token, and tokens/s."""
    node = build_pipeline(cfg, datasets=dict(datasets))
    node.reset()
    counts = np.zeros((batches, len(RANGES)), np.int64)
    t0 = time.perf_counter()
    for b in range(batches):
        ids = np.asarray(next(node)["input_ids"]).ravel()
        for k, (lo, hi) in enumerate(RANGES.values()):
            counts[b, k] = int(np.count_nonzero((ids >= lo) & (ids < hi)))
    seconds = time.perf_counter() - t0
    names = list(RANGES)
    out: dict[str, Any] = {"tokens_per_s": counts.sum() / seconds}
    first_long = np.flatnonzero(counts[:, names.index("long")])
    out["first_long"] = int(first_long[0]) + 1 if len(first_long) else None
    for w in windows:
        total = counts[:w].sum()
        out[w] = {
            g: counts[:w, [names.index(n) for n in members]].sum() / total
            for g, members in groups.items()
        }
    return out


def quick_start_corpus(seed: int) -> dict[str, DatasetIndex]:
    """The README quick start's two text datasets: 2,000 short documents each, ``web`` written
    in the letters a-m and ``code`` in n-z, so every byte tells its dataset."""
    rng = np.random.default_rng(seed)
    letters = {"web": list("abcdefghijklm"), "code": list("nopqrstuvwxyz")}
    return {
        name: DatasetIndex.from_documents(
            name, ["".join(rng.choice(ch, 10 + int(rng.integers(0, 300)))) for _ in range(2000)]
        )
        for name, ch in letters.items()
    }


def quick_start(seed: int, quantum: int | None, batches: int, windows: list[int]) -> dict:
    """``web``'s share of the document bytes of batches 1..w, for each ``w`` in ``windows``."""
    cfg = PipelineConfig(
        data_path="memory", datasets="web,code", weights="3,1", tokenizer="byte",
        seq_length=128, batch_size=4, logical_shards=8, shuffle_buffer=100, seed=seed,
        mix_quantum_tokens=quantum,
    )  # fmt: skip
    node = build_pipeline(cfg, datasets=quick_start_corpus(seed))
    node.reset()
    # the byte tokenizer maps byte b to id b + 1
    web = (ord("a") + 1, ord("m") + 1)
    code = (ord("n") + 1, ord("z") + 1)
    counts = np.zeros((batches, 2), np.int64)
    for b in range(batches):
        ids = np.asarray(next(node)["input_ids"]).ravel()
        counts[b] = (
            np.count_nonzero((ids >= web[0]) & (ids <= web[1])),
            np.count_nonzero((ids >= code[0]) & (ids <= code[1])),
        )
    return {w: counts[:w, 0].sum() / max(1, counts[:w].sum()) for w in windows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    # the corpus is small next to the 10,000-row buffer (epochs mix in it): said once here
    logging.getLogger("torchdata_ext.nodes.shuffle").setLevel(logging.ERROR)
    windows = [w for w in (50, 200, 1000) if w <= args.batches]
    groups = {"code": ["code", "long"], "prose": ["prose"]}
    print(f"long document corpus, weights code 1 : prose 2 (target code {100 / 3:.1f}%), "
          f"default config, {args.batches} batches of 8 x 4,097")  # fmt: skip
    print("seed  mix                  " + "  ".join(f"code 1-{w:<5}" for w in windows)
          + "  long doc in batch  tokens/s")  # fmt: skip
    for seed in args.seeds:
        datasets = long_document_corpus(seed)
        for quantum, fill, whole, label in (
            (OLD_DEFAULT, "stream", True, "65536, whole docs"),
            (None, "stream", True, "4096, whole docs"),
            (None, "stream", False, "4096, row cuts"),
            (None, "full", False, "row cuts, fill full"),
        ):
            cfg = PipelineConfig(
                data_path="memory", datasets="code,prose", weights="1,2", seed=seed,
                tokenizer=None, mix_quantum_tokens=quantum, shuffle_fill=fill,
            )  # fmt: skip
            with whole_documents(whole):
                r = shares(cfg, datasets, args.batches, windows, groups)
            cells = "  ".join(f"{100 * r[w]['code']:>10.1f}%" for w in windows)
            print(f"{seed:<4}  {label:<19}  {cells}  {r['first_long']!s:>17}  "
                  f"{r['tokens_per_s'] / 1e6:.1f}M")  # fmt: skip
    qs = [w for w in (11, 50, 200) if w <= args.batches]
    print("\nquick start (README), web 3 : code 1 (target web 75.0%), seq 128, batch 4")
    print("seed  mix_quantum_tokens  " + "  ".join(f"web 1-{w:<4}" for w in qs))
    for seed in args.seeds:
        for quantum, label in ((OLD_DEFAULT, "65536 (old)"), (None, "None = 128 (new)")):
            r = quick_start(seed, quantum, max(qs), qs)
            print(f"{seed:<4}  {label:<18}  " + "  ".join(f"{100 * r[w]:>9.1f}%" for w in qs))


if __name__ == "__main__":
    main()
