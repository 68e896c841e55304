"""Loader overhead as a training loop feels it: the loader's share of each step.

A training loop holds the main thread for a fixed simulated step (torch matmuls on one
intra-op thread, standing in for a GPU step that leaves the other core to the loader: ~50 ms,
and ~5 ms for a small model) and calls ``next(loader)`` and ``loader.state_dict()`` every step.
For each loading path (in-process background thread, 1 and 2 worker processes) it prints the
time the main thread spent in the loader per step, its share of the step, and the tokens/s
delivered; then the same paths with no simulated step (the loader's own rate), next to the
bare pipeline's rate measured in the same run.

It also measures what a worker ships per batch for its state (the pickled deltas) and what
applying them costs the main process, with a 10,000-sequence buffer over 3 x 1,024 shards.

Corpus: 3 sub-datasets 3:1:1 of uint32 Arrow (Bamba layout), seq 4096 + 1, batch 8,
10,000-sequence shuffle buffer.

    python benchmarks/loader_overhead.py [--tokens 150_000_000] [--steps 200] [--repeat 3]
        [--quick] [--layout]

``--layout`` measures only what contiguous ``input_ids`` / ``labels`` cost (``PackedBatch.
to_tensors`` copies them out of the ``[B, L + 1]`` token tensor so every path gives the same
layout): the loader's rate with those copies and, alternately in the same run, with the views
the copies replaced (``batch._contiguous`` swapped for the identity), for 2 worker processes
(the path that copies) and the in-process thread (a control: it never had views, so its ratio
shows the machine's noise).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pickle
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _corpus import BAMBA_SHARES, bamba_corpus  # noqa: E402

from torchdata_ext import World, batch  # noqa: E402
from torchdata_ext.loader.token_loader import TokenLoader, _PipelineIterator  # noqa: E402
from torchdata_ext.pipeline.build import build_datasets, build_pipeline  # noqa: E402
from torchdata_ext.pipeline.config import PipelineConfig  # noqa: E402
from torchdata_ext.state.delta import apply  # noqa: E402


def _build(cfg: PipelineConfig, datasets, world: World):
    return build_pipeline(cfg, world, datasets)


class Step:
    """A fixed amount of matmul work on one intra-op thread, calibrated to ``ms``."""

    def __init__(self, ms: float) -> None:
        self.a = torch.randn(256, 256)
        for _ in range(20):  # warm up
            self.a @ self.a
        t0 = time.perf_counter()
        for _ in range(200):
            self.a @ self.a
        per = (time.perf_counter() - t0) / 200
        self.reps = max(1, round(ms / 1000 / per))
        self.ms = ms

    def __call__(self) -> None:
        for _ in range(self.reps):
            self.a @ self.a


def run_loop(make, step: Step | None, steps: int) -> tuple[float, float, float]:
    """Seconds in the loader per step (next + state_dict), its share of the step, tokens/s."""
    loader = make()
    it = iter(loader)
    for _ in range(4):  # the buffer fill and worker start-up are not the steady state
        next(it)
        loader.state_dict()
    in_loader = 0.0
    tokens = 0
    t_start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(it)
        loader.state_dict()
        in_loader += time.perf_counter() - t0
        tokens += batch["input_ids"].numel()
        if step is not None:
            step()
    wall = time.perf_counter() - t_start
    del it, loader
    return in_loader / steps, in_loader / wall, tokens / wall


def bare_rate(cfg: PipelineConfig, datasets, batches: int) -> float:
    node = build_pipeline(cfg, World(), datasets)
    next(node)
    t0 = time.perf_counter()
    tokens = sum(next(node)["input_ids"].numel() for _ in range(batches))
    return tokens / (time.perf_counter() - t0)


def state_traffic(cfg: PipelineConfig, datasets, batches: int) -> tuple[float, float, float]:
    """Per batch: pickled bytes of the state deltas a worker sends, and the main process's
    seconds to unpickle and apply them; and the size of the whole state (bytes)."""
    it = _PipelineIterator(functools.partial(_build, cfg, datasets), World(), None, delta=True)
    msg = next(it)  # the first message carries the whole state
    state = apply(None, msg.states[0])
    full = len(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
    sizes, costs = [], []
    for _ in range(batches):
        msg = next(it)
        raw = pickle.dumps(msg.states, protocol=pickle.HIGHEST_PROTOCOL)
        t0 = time.perf_counter()
        for ops in pickle.loads(raw):
            state = apply(state, ops)
        costs.append(time.perf_counter() - t0)
        sizes.append(len(raw))
    return statistics.mean(sizes), statistics.mean(costs), full


def layout_cost(cfg: PipelineConfig, datasets, steps: int, repeat: int) -> None:
    """What the contiguous ``input_ids`` / ``labels`` cost against the strided views they
    replaced: ``to_tensors()`` per batch (CPU time, which other processes disturb little), and
    the loader's rate (a 64-sequence buffer: the start-up fill is not what is measured),
    alternately, ``repeat`` rounds each."""
    cfg = dataclasses.replace(cfg, shuffle_buffer=64)
    contiguous = batch._contiguous
    node = build_pipeline(cfg, World(), datasets)
    packed = [node.next_packed_batch() for _ in range(32)]
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeat * 5):
        for copy in (False, True):
            batch._contiguous = contiguous if copy else (lambda t: t)  # type: ignore[assignment]
            t0 = time.process_time()
            for b in packed:
                b.to_tensors()
            cpu[copy].append((time.process_time() - t0) / len(packed))
    batch._contiguous = contiguous  # type: ignore[assignment]
    print(
        f"to_tensors() per batch of 8 x 4096 (CPU time, best of {repeat * 5}): contiguous "
        f"{min(cpu[True]) * 1e3:.3f} ms, strided views {min(cpu[False]) * 1e3:.3f} ms"
    )
    build = functools.partial(_build, cfg, datasets)
    paths = {"in-process thread (control, no copy)": 0, "2 worker processes": 2}
    rates: dict[tuple[str, bool], list[float]] = {}
    for _ in range(repeat):
        for label, workers in paths.items():
            for copy in (False, True):
                batch._contiguous = contiguous if copy else (lambda t: t)  # type: ignore[assignment]
                try:
                    make = functools.partial(TokenLoader, build, num_workers=workers)
                    _, _, rate = run_loop(make, None, steps)
                finally:
                    batch._contiguous = contiguous  # type: ignore[assignment]
                rates.setdefault((label, copy), []).append(rate)
    for label in paths:
        views, copies = rates[(label, False)], rates[(label, True)]
        print(
            f"TokenLoader, {label}, no training step: contiguous input_ids/labels "
            f"{max(copies) / 1e6:.1f}M tokens/s vs strided views {max(views) / 1e6:.1f}M = "
            f"{max(copies) / max(views):.2f}x (best of {repeat}; medians "
            f"{statistics.median(copies) / statistics.median(views):.2f}x)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=150_000_000, help="corpus size (tokens)")
    p.add_argument("--data-dir", default="bench_data/pipeline")
    p.add_argument("--steps", type=int, default=200, help="training steps per measurement")
    p.add_argument("--shards", type=int, default=1024, help="logical shards per dataset")
    p.add_argument("--repeat", type=int, default=3, help="rounds of the no-step comparison")
    p.add_argument("--quick", action="store_true", help="small corpus and few steps")
    p.add_argument("--layout", action="store_true", help="only the contiguous-layout cost")
    args = p.parse_args()
    if args.quick:
        args.tokens, args.steps, args.shards = 20_000_000, 40, 256
    torch.set_num_threads(1)  # the simulated step leaves the other core to the loader

    root = bamba_corpus(args.data_dir, args.tokens)
    shares = BAMBA_SHARES
    cfg = PipelineConfig(
        data_path=root, datasets=list(shares), weights=[3, 1, 1], seq_length=4096, batch_size=8,
        shuffle_buffer=10_000, logical_shards=args.shards, eos_token=0, block_docs=256,
        dtype="int32",
    )  # fmt: skip
    datasets = build_datasets(cfg)
    if args.layout:
        layout_cost(cfg, datasets, args.steps * 2, args.repeat)
        return
    build = functools.partial(_build, cfg, datasets)

    steps = {ms: Step(ms) for ms in (50.0, 5.0)}  # calibrated before any loader runs
    size, cost, full = state_traffic(cfg, datasets, 100)
    print(
        f"state per batch through a worker ({args.shards} shards x 3 datasets, 10,000-sequence "
        f"buffer): {size / 1024:.1f} KB shipped (whole state {full / 1024:.0f} KB), "
        f"{cost * 1e3:.3f} ms to apply in the main process"
    )

    paths = {
        "in-process thread": dict(num_workers=0),
        "1 worker process": dict(num_workers=1),
        "2 worker processes": dict(num_workers=2),
    }
    # the bare pipeline and each path alternately, --repeat rounds: a shared machine's noise
    # (and the page cache warming up) moves single runs by 20%; ratios of the bests (and of the
    # medians) are what compare
    bares: list[float] = []
    rates: dict[str, list[float]] = {label: [] for label in paths}
    for _ in range(args.repeat):
        bares.append(bare_rate(cfg, datasets, max(100, args.steps)))
        for label, kw in paths.items():
            _, _, rate = run_loop(lambda kw=kw: TokenLoader(build, **kw), None, args.steps * 2)
            rates[label].append(rate)
    bare, bare_med = max(bares), statistics.median(bares)
    print(
        f"bare pipeline, one process: {bare / 1e6:.1f}M tokens/s (the reference; best of "
        f"{len(bares)}, median {bare_med / 1e6:.1f}M)"
    )
    for label, got in rates.items():
        best, med = max(got), statistics.median(got)
        print(
            f"TokenLoader, {label}, state every step, no training step: "
            f"{best / 1e6:6.1f}M tokens/s = {best / bare:.2f}x the bare pipeline (best of "
            f"{len(got)}; medians {med / 1e6:.1f}M = {med / bare_med:.2f}x)"
        )
    for ms, step in steps.items():
        for label, kw in paths.items():
            per, share, rate = run_loop(lambda kw=kw: TokenLoader(build, **kw), step, args.steps)
            print(
                f"{ms:4.0f} ms step ({per / share * 1e3:.0f} ms measured), {label}: loader "
                f"{per * 1e3:6.2f} ms per step on the "
                f"training thread = {share * 100:5.1f}% of the step; {rate / 1e6:5.1f}M tokens/s"
            )


if __name__ == "__main__":
    main()
