"""The cost of ``dataset_ids`` (each token's dataset, for a loss per dataset): the same loader
with and without the key, in the same run.

The Bamba-style corpus of ``pipeline_throughput.py`` (three weighted sources, lognormal
document lengths), seq_len 4096, batch 8, ``output_keys`` ``input_ids,labels,position_ids``
with and without ``dataset_ids``. Two measurements, each alternating the two configs
``--repeat`` times (the machine may be shared: compare the ratios):

* the training process's share: ``PackedBatch.to_tensors()`` of the same compact batches
  (what a worker sends) with and without the key, microseconds per batch;
* end to end: ``TokenLoader`` with ``--workers`` worker processes and ``state_dict()`` at every
  step, tokens per second and CPU seconds per million tokens of the process tree, after
  the buffer fill.

    python benchmarks/dataset_ids_cost.py [--tokens 20_000_000] [--batches 200] [--repeat 3]
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
from _cpu import tree_cpu  # noqa: E402

from torchdata_ext import World  # noqa: E402
from torchdata_ext.batch import DATASET_KEY, HF_KEYS, PackedBatch  # noqa: E402
from torchdata_ext.loader.token_loader import TokenLoader  # noqa: E402
from torchdata_ext.pipeline.build import build_datasets, build_pipeline  # noqa: E402
from torchdata_ext.pipeline.config import PipelineConfig  # noqa: E402


def _build(cfg: PipelineConfig, datasets, world: World):
    return build_pipeline(cfg, world, datasets)


def to_tensors_us(cfg: PipelineConfig, datasets, n: int, repeat: int) -> dict[str, list[float]]:
    """Microseconds per ``to_tensors()`` of ``n`` compact batches, with and without the key."""
    node = build_pipeline(cfg, World(), datasets)
    node.reset()
    with_key: list[PackedBatch] = [node.next_packed_batch() for _ in range(n)]
    plain = [dataclasses.replace(b, keys=HF_KEYS, datasets=None) for b in with_key]
    out: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(repeat):
        for label, batches in (("without", plain), ("with", with_key)):
            t0 = time.perf_counter()
            for b in batches:
                b.to_tensors()
            out[label].append((time.perf_counter() - t0) / n * 1e6)
    return out


def loader_rates(
    cfgs: dict[str, PipelineConfig], datasets, workers: int, n: int, repeat: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Tokens/s and CPU s per million tokens of a ``TokenLoader`` per config, alternately."""
    rates: dict[str, list[float]] = {k: [] for k in cfgs}
    cpu: dict[str, list[float]] = {k: [] for k in cfgs}
    for _ in range(repeat):
        for label, cfg in cfgs.items():
            loader = TokenLoader(functools.partial(_build, cfg, datasets), num_workers=workers)
            it = iter(loader)
            fill = -(-cfg.shuffle_buffer * max(1, workers) // cfg.batch_size)
            for _ in range(fill + 5 * max(1, workers)):
                next(it)
            t0, c0 = time.perf_counter(), tree_cpu()
            tokens = 0
            for _ in range(n):
                tokens += next(it)["input_ids"].numel()
                loader.state_dict()
            rates[label].append(tokens / (time.perf_counter() - t0))
            cpu[label].append((tree_cpu() - c0) / tokens * 1e6)
            loader.close()
    return rates, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=20_000_000, help="corpus size (tokens)")
    p.add_argument("--data-dir", default="bench_data/pipeline")
    p.add_argument("--batches", type=int, default=200, help="batches per measurement")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="alternating runs; best and median")
    p.add_argument("--pack-mode", default="concat")
    args = p.parse_args()

    root = bamba_corpus(args.data_dir, args.tokens)
    base = dict(
        data_path=root, datasets=list(BAMBA_SHARES), weights=[3, 1, 1], seq_length=4096,
        batch_size=8, shuffle_buffer=256, logical_shards=64, eos_token=0, block_docs=256,
        pack_mode=args.pack_mode, dtype="int32", shift=True,
    )  # fmt: skip
    cfgs = {
        "without": PipelineConfig(**base, output_keys=list(HF_KEYS)),
        "with": PipelineConfig(**base, output_keys=[*HF_KEYS, DATASET_KEY]),
    }
    datasets = build_datasets(cfgs["with"])
    us = to_tensors_us(cfgs["with"], datasets, args.batches, args.repeat)
    for label, got in us.items():
        print(
            f"to_tensors(), {label} dataset_ids: {min(got):7.1f} us/batch (best of {len(got)}; "
            f"median {statistics.median(got):.1f})"
        )
    print(f"  the key's share: {min(us['with']) - min(us['without']):.1f} us/batch (bests)")
    rates, cpu = loader_rates(cfgs, datasets, args.workers, args.batches, args.repeat)
    for label in cfgs:
        got = rates[label]
        print(
            f"TokenLoader, {args.workers} workers, {label} dataset_ids: {max(got) / 1e6:6.1f}M "
            f"tokens/s (best of {len(got)}; median {statistics.median(got) / 1e6:.1f}M); CPU s "
            f"per M tokens {min(cpu[label]):.4f} (least)"
        )
    print(
        f"  ratio with / without (bests): {max(rates['with']) / max(rates['without']):.3f}; "
        f"CPU per token {min(cpu['with']) / min(cpu['without']):.3f}"
    )


if __name__ == "__main__":
    main()
