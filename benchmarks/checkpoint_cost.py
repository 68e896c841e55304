"""Checkpoint cost of the full Bamba-style pipeline: state size, state_dict() time, save/restore.

Three weighted Arrow sources, 1,024 logical shards each, seq_len 4096, batch 8, a 10,000-sequence
shuffle buffer (full), one worker. Prints the pickled state size per worker, the time of one
``state_dict()`` call (what ``snapshot_every_n_steps=1`` pays every step) next to the time of
one training batch from the same loader (the reference, measured in the same run), and the
wall time to save a folder checkpoint and to restore from it (the restore re-reads the
shuffle buffer's documents from their provenance).

    python benchmarks/checkpoint_cost.py [--tokens 80_000_000] [--shuffle-buffer 10000]
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _corpus import BAMBA_SHARES, bamba_corpus  # noqa: E402

from torchdata_ext import World  # noqa: E402
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint  # noqa: E402
from torchdata_ext.loader.token_loader import TokenLoader  # noqa: E402
from torchdata_ext.pipeline.build import build_datasets, build_pipeline  # noqa: E402
from torchdata_ext.pipeline.config import PipelineConfig  # noqa: E402


def build(cfg: PipelineConfig, datasets, world: World):
    return build_pipeline(cfg, world, datasets)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=80_000_000)
    p.add_argument("--shuffle-buffer", type=int, default=10_000)
    p.add_argument("--logical-shards", type=int, default=1024)
    p.add_argument("--data-dir", default="bench_data/pipeline")
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()

    root = bamba_corpus(args.data_dir, args.tokens)
    shares = BAMBA_SHARES
    cfg = PipelineConfig(
        data_path=root, datasets=list(shares), weights=[3, 1, 1], seq_length=4096, batch_size=8,
        shuffle_buffer=args.shuffle_buffer, logical_shards=args.logical_shards, eos_token=0,
        block_docs=256, dtype="int32",
    )  # fmt: skip
    datasets = build_datasets(cfg)
    loader = TokenLoader(functools.partial(build, cfg, datasets))
    it = iter(loader)
    t0 = time.perf_counter()
    next(it)  # fills the shuffle buffer
    fill = time.perf_counter() - t0
    step_times, state_times = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        next(it)
        t1 = time.perf_counter()
        state = loader.state_dict()
        t2 = time.perf_counter()
        step_times.append(t1 - t0)
        state_times.append(t2 - t1)
    size = len(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
    step, snap = (
        sorted(step_times)[len(step_times) // 2],
        sorted(state_times)[len(state_times) // 2],
    )
    print(f"buffer fill (first batch): {fill:.1f}s")
    print(f"state per worker: {size / 1e6:.2f} MB pickled ({args.logical_shards} shards x 3 datasets, "
          f"{args.shuffle_buffer}-sequence shuffle buffer)")  # fmt: skip
    print(f"state_dict() per step: {snap * 1e3:.2f} ms; one batch: {step * 1e3:.2f} ms; "
          f"ratio state/batch: {snap / step:.2f}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        save_checkpoint(loader, tmp)
        t1 = time.perf_counter()
        fresh = TokenLoader(functools.partial(build, cfg, datasets))
        load_checkpoint(fresh, tmp)
        next(iter(fresh))
        t2 = time.perf_counter()
    print(f"checkpoint save: {(t1 - t0) * 1e3:.0f} ms; restore + first batch: {t2 - t1:.1f}s "
          f"(vs {fill:.1f}s to fill the buffer from scratch)")  # fmt: skip
    # the same through one dataloader worker process: what a snapshot at every step costs
    # there (state_dict + pickling + sending it with the batch) next to snapshots every 100
    per_batch = {}
    for every in (100, 1):
        worker = TokenLoader(
            functools.partial(build, cfg, datasets), num_workers=1, snapshot_every_n_steps=every
        )
        it = iter(worker)
        for _ in range(5):
            next(it)
        t0 = time.perf_counter()
        for _ in range(args.steps * 4):
            next(it)
        per_batch[every] = (time.perf_counter() - t0) / (args.steps * 4)
        del it, worker
    print(f"1 worker process: {per_batch[1] * 1e3:.2f} ms per batch with a snapshot every step, "
          f"{per_batch[100] * 1e3:.2f} ms with one every 100 "
          f"(ratio {per_batch[1] / per_batch[100]:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
