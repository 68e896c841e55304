"""Write the small text corpus examples/torchtitan/pipeline.yaml reads (two JSONL datasets).

python examples/torchtitan/write_data.py [--out examples/torchtitan/data]
"""

from __future__ import annotations

import argparse

import numpy as np

from torchdata_ext.testing import write_jsonl

WORDS = [
    "the",
    "a",
    "loader",
    "shard",
    "token",
    "model",
    "data",
    "epoch",
    "rank",
    "worker",
    "batch",
    "train",
    "step",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="examples/torchtitan/data")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for name, n_docs in (("web", 2000), ("code", 1000)):
        texts = [" ".join(rng.choice(WORDS, 5 + int(rng.exponential(60)))) for _ in range(n_docs)]
        for f in range(4):
            write_jsonl(f"{args.out}/{name}/part{f}.jsonl", texts[f::4])
    print(f"wrote 2 datasets x 4 files under {args.out}")


if __name__ == "__main__":
    main()
