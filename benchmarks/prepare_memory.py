"""Peak memory of ``prepare`` against the size of one input file (issue 44 item 21).

Writes one JSONL file of each size (random words, ~300 bytes a document), then runs
``torchdata_ext.prepare`` on it in a fresh process (byte tokenizer, Arrow outputs of
``--max-tokens-per-file`` tokens) and prints that process's peak resident memory
(``ru_maxrss``) and time: with the default ``chunk_documents`` (memory bounded by the range
read at a time) and with the whole file as one range (what ``prepare`` did before). The
first should stay flat as the file grows; the second grows with it.

    python benchmarks/prepare_memory.py [--sizes-mb 20 80] [--chunk-documents 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

_CHILD = """
import resource, sys, time
import torchdata_ext
t = time.perf_counter()
res = torchdata_ext.prepare(sys.argv[1], sys.argv[2], progress=False,
                            max_tokens_per_file=int(sys.argv[3]), chunk_documents=int(sys.argv[4]))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, time.perf_counter() - t,
      res.documents)
"""


def _write_input(path: str, megabytes: int, seed: int = 0) -> int:
    """A JSONL file of about ``megabytes`` MB; its documents."""
    rng = np.random.default_rng(seed)
    words = np.array(["data", "loader", "token", "shard", "epoch", "rescale", "über", "naïve"])
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        while f.tell() < megabytes * 2**20:
            for _ in range(1000):
                text = " ".join(rng.choice(words, int(rng.integers(10, 80))))
                f.write(json.dumps({"text": text}) + "\n")
                n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[20, 80])
    ap.add_argument("--chunk-documents", type=int, default=10_000)
    ap.add_argument("--max-tokens-per-file", type=int, default=10_000_000)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    print(f"{'input MB':>9} {'documents':>10} {'chunk_documents':>16} {'peak RSS MB':>12} {'s':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for mb in args.sizes_mb:
            src = os.path.join(tmp, f"in{mb}")
            os.makedirs(src)
            docs = _write_input(os.path.join(src, "big.jsonl"), mb)
            for chunk in (args.chunk_documents, 10**12):
                out = os.path.join(tmp, f"out{mb}_{chunk}")
                t0 = time.perf_counter()
                got = subprocess.run(
                    [sys.executable, "-c", _CHILD, src, out, str(args.max_tokens_per_file),
                     str(chunk)],
                    env=env, check=True, capture_output=True, text=True,
                )  # fmt: skip
                rss, secs, n = got.stdout.split()
                assert int(n) == docs, (n, docs)
                label = "whole file" if chunk == 10**12 else f"{chunk:,}"
                print(f"{mb:>9} {docs:>10,} {label:>16} {float(rss):>12.0f} {float(secs):>7.1f}")
                del t0


if __name__ == "__main__":
    main()
