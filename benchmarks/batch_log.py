"""What the batch log costs a training loop: ``TokenLoader`` (2 workers, and 0: in this process)
delivering ``--steps`` batches, alternately ``--repeat`` times, in one run:

* plain: the config's default keys;
* provenance: ``provenance`` added to the batch keys (what the log needs);
* logged: with provenance, and each step written to a JSONL file by ``BatchLog``.

It prints the median time per step of each and the differences, per loading path; then the
log's own time per step (``BatchLog.write`` alone, over batches taken from the loader), which
a loaded machine measures more precisely than the difference of two loader runs.

Corpus: 3 sub-datasets 3:1:1 of uint32 Arrow (Bamba layout), seq 1024 + 1, batch 8,
1,000-sequence shuffle buffer, 64 logical shards (as ``benchmarks/replay.py``).

    python benchmarks/batch_log.py [--tokens 12_000_000] [--steps 500] [--repeat 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _corpus import BAMBA_SHARES, bamba_corpus  # noqa: E402

from torchdata_ext import TokenLoader  # noqa: E402
from torchdata_ext.forensics import BatchLog  # noqa: E402
from torchdata_ext.pipeline.build import build_pipeline  # noqa: E402
from torchdata_ext.pipeline.config import PipelineConfig  # noqa: E402


def config(root: str, keys: list[str]) -> PipelineConfig:
    return PipelineConfig(
        data_path=root, datasets=list(BAMBA_SHARES), weights=[3, 1, 1], seq_length=1024,
        batch_size=8, eos_token=0, logical_shards=64, shuffle_buffer=1000, seed=1,
        output_keys=keys,
    )  # fmt: skip


def per_step(cfg: PipelineConfig, workers: int, steps: int, log: str | None) -> float:
    """Milliseconds per step over ``steps`` steps (after 20 steps of warm-up)."""
    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=workers)
    writer = BatchLog(log, cfg.datasets) if log else None
    start = 0.0
    for step, batch in enumerate(loader, 1):
        if step == 20:
            start = time.perf_counter()
        if writer is not None:
            writer.write(step, batch, loss=0.0)
        if step == 20 + steps:
            break
    took = time.perf_counter() - start
    loader.close()
    if writer is not None:
        writer.close()
    return took / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=lambda s: int(s.replace("_", "")), default=12_000_000)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--data-dir", default=os.path.join(os.path.dirname(__file__), "..", "bench_data")
    )
    args = ap.parse_args()
    root = bamba_corpus(args.data_dir, args.tokens)
    plain = config(root, ["input_ids", "labels", "position_ids"])
    prov = dataclasses.replace(plain, output_keys=[*plain.output_keys, "provenance"])
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        for workers in (2, 0):
            times: dict[str, list[float]] = {"plain": [], "provenance": [], "logged": []}
            for _ in range(args.repeat):
                times["plain"].append(per_step(plain, workers, args.steps, None))
                times["provenance"].append(per_step(prov, workers, args.steps, None))
                times["logged"].append(per_step(prov, workers, args.steps, log))
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"{workers} workers, ms per step (median of {args.repeat} x {args.steps} steps):")
            for k, v in med.items():
                print(f"  {k:<11} {v:7.3f}")
            print(f"  provenance - plain: {med['provenance'] - med['plain']:+.3f} ms; "
                  f"logged - provenance: {med['logged'] - med['provenance']:+.3f} ms")  # fmt: skip
        own = []
        batches = []
        loader = TokenLoader(functools.partial(build_pipeline, prov), num_workers=0)
        for batch in loader:
            batches.append(batch)
            if len(batches) == args.steps:
                break
        loader.close()
        for _ in range(args.repeat):
            with BatchLog(os.path.join(tmp, "alone.jsonl"), prov.datasets) as writer:
                start = time.perf_counter()
                for step, batch in enumerate(batches, 1):
                    writer.write(step, batch, loss=0.0)
                own.append((time.perf_counter() - start) / len(batches) * 1e6)
        print(f"BatchLog.write alone: {statistics.median(own):.0f} us per step")
        with open(log, "rb") as f:
            lines = sum(1 for _ in f)
        print(f"log: {os.path.getsize(log) / lines:.0f} bytes per step")


if __name__ == "__main__":
    main()
