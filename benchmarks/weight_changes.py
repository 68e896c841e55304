"""The cost of changing the weights during the run: each change (a ``set_weights`` call, a
``weight_schedule`` point, a stair of a linear ramp) restarts the workers from the exact state.

The Bamba-style corpus of ``pipeline_throughput.py`` (three weighted sources), seq_len 4096,
batch 8, ``TokenLoader`` with ``--workers`` worker processes and ``state_dict()`` at every step.
The same loader with no schedule and with a linear ramp 3:1:1 -> 1:1:3 over the measured
steps in stairs of ``--every`` steps, alternated ``--repeat`` times (the machine may be shared:
compare the ratios). Prints tokens/s of each, the ratio, and the seconds a change costs
(the difference of the two runs' times over the number of changes).

    python benchmarks/weight_changes.py [--tokens 20_000_000] [--batches 200] [--every 10 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _corpus import BAMBA_SHARES, bamba_corpus  # noqa: E402

from torchdata_ext import World  # noqa: E402
from torchdata_ext.loader.token_loader import TokenLoader  # noqa: E402
from torchdata_ext.pipeline.build import build_datasets, build_pipeline  # noqa: E402
from torchdata_ext.pipeline.config import PipelineConfig  # noqa: E402


def _build(cfg: PipelineConfig, datasets, world: World):
    return build_pipeline(cfg, world, datasets)


def timed(cfg: PipelineConfig, datasets, workers: int, warm: int, n: int) -> tuple[float, int]:
    """Seconds for batches ``warm + 1 .. warm + n`` (a state every step) and the changes made."""
    loader = TokenLoader(functools.partial(_build, cfg, datasets), num_workers=workers)
    changes = sum(1 for p in loader.weight_points() if warm < p[0] <= warm + n)
    it = iter(loader)
    for _ in range(warm):
        next(it)
        loader.state_dict()
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
        loader.state_dict()
    took = time.perf_counter() - t0
    loader.close()
    return took, changes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=20_000_000, help="corpus size (tokens)")
    p.add_argument("--data-dir", default="bench_data/pipeline")
    p.add_argument("--batches", type=int, default=200, help="batches per measurement")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--buffer", type=int, default=256, help="shuffle_buffer (rows)")
    p.add_argument("--every", type=int, nargs="+", default=[10, 50], help="stair length (steps)")
    p.add_argument("--repeat", type=int, default=3, help="alternating runs; best and median")
    args = p.parse_args()

    root = bamba_corpus(args.data_dir, args.tokens)
    base = PipelineConfig(
        data_path=root, datasets=list(BAMBA_SHARES), weights=[3, 1, 1], seq_length=4096,
        batch_size=8, shuffle_buffer=args.buffer, logical_shards=64, eos_token=0,
        block_docs=256, dtype="int32",
    )  # fmt: skip
    warm = -(-args.buffer * max(1, args.workers) // base.batch_size) + 5 * max(1, args.workers)
    last = warm + args.batches
    cfgs = {"no schedule": base}
    for every in args.every:
        cfgs[f"ramp every {every}"] = dataclasses.replace(
            base, weight_schedule={warm: "3,1,1", last: "1,1,3"}, weight_schedule_ramp_every=every
        )
    datasets = build_datasets(base)
    took: dict[str, list[float]] = {k: [] for k in cfgs}
    changes: dict[str, int] = {}
    for _ in range(args.repeat):
        for label, cfg in cfgs.items():
            t, changes[label] = timed(cfg, datasets, args.workers, warm, args.batches)
            took[label].append(t)
    tokens = args.batches * base.batch_size * base.seq_length
    ref = min(took["no schedule"])
    print(
        f"TokenLoader, {args.workers} workers, shuffle_buffer {args.buffer}, {args.batches} "
        f"batches after {warm} (a state every step)"
    )
    for label, got in took.items():
        rate = tokens / min(got)
        line = (
            f"  {label:>14}: {rate / 1e6:6.1f}M tokens/s (best of {len(got)}; median "
            f"{tokens / statistics.median(got) / 1e6:.1f}M), ratio to no schedule "
            f"{ref / min(got):.3f}"
        )
        if changes[label]:
            per = (min(got) - ref) / changes[label]
            line += f"; {changes[label]} changes, {per:.3f} s each"
        print(line)


if __name__ == "__main__":
    main()
