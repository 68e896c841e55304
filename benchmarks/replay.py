"""Replaying steps from a checkpoint (``show_batches``) next to the loader's own time for them.

A run (1 rank x 2 dataloader workers) is checkpointed at step 10. Then, in one run of this
script, alternately ``--repeat`` times:

* loader: a ``TokenLoader`` (the same 2 workers) restored from the checkpoint delivers steps
  11 .. 10 + ``--ahead`` (timed from the restore to the last batch);
* pipeline: the loader's work without its processes: the two workers' graphs (with
  ``Collate``) restored in this process and pulled in turn for the same batches;
* replay: ``show_batches`` of step 10 + ``--ahead`` from the same checkpoint (restore,
  fast-forward over the steps before it without making rows or batches, then the one step
  shown).

It prints the medians and the ratios of replay to each; and the replay of the first step after
the checkpoint alone (the restore, its checks and the graphs: the fixed part of any replay).

Corpus: 3 sub-datasets 3:1:1 of uint32 Arrow (Bamba layout), seq 1024 + 1, batch 8,
1,000-sequence shuffle buffer, 64 logical shards.

    python benchmarks/replay.py [--tokens 12_000_000] [--ahead 1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _corpus import BAMBA_SHARES, bamba_corpus  # noqa: E402

from torchdata_ext import TokenLoader, show_batches  # noqa: E402
from torchdata_ext.checkpoint.folder import (  # noqa: E402
    load_checkpoint,
    read_worker_states,
    save_checkpoint,
)
from torchdata_ext.pipeline.build import build_pipeline  # noqa: E402
from torchdata_ext.pipeline.config import PipelineConfig  # noqa: E402

SAVED = 10


def config(root: str) -> PipelineConfig:
    return PipelineConfig(
        data_path=root, datasets=list(BAMBA_SHARES), weights=[3, 1, 1], seq_length=1024,
        batch_size=8, eos_token=0, logical_shards=64, shuffle_buffer=1000, seed=1,
        output_keys=["input_ids", "labels", "provenance"],
    )  # fmt: skip


def loader_time(cfg: PipelineConfig, ckpt: str, workers: int, ahead: int) -> float:
    """Seconds for a loader restored from ``ckpt`` to deliver ``ahead`` batches."""
    start = time.perf_counter()
    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=workers)
    load_checkpoint(loader, ckpt)
    n = 0
    for _ in loader:
        n += 1
        if n == ahead:
            break
    took = time.perf_counter() - start
    loader.close()
    if n != ahead:
        raise SystemExit(f"the corpus ends after {n} steps; raise --tokens")
    return took


def pipeline_time(cfg: PipelineConfig, ckpt: str, ahead: int) -> float:
    """Seconds for the checkpoint's two worker graphs, restored in this process, to make the
    ``ahead`` batches (taken in turn, as the loader does)."""
    start = time.perf_counter()
    roots = []
    for world, _meta, graph in read_worker_states(ckpt):
        root = build_pipeline(cfg, world)
        root.reset(graph)
        roots.append(root)
    for i in range(ahead):
        batch = next(roots[i % len(roots)])
    took = time.perf_counter() - start
    assert batch["input_ids"].shape == (cfg.batch_size, cfg.seq_length)
    return took


def replay_time(cfg: PipelineConfig, ckpt: str, ahead: int) -> float:
    start = time.perf_counter()
    (shown,) = show_batches(ckpt, cfg, SAVED + ahead)
    took = time.perf_counter() - start
    assert shown["step"] == SAVED + ahead and len(shown["rows"]) == cfg.batch_size
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=lambda s: int(s.replace("_", "")), default=12_000_000)
    ap.add_argument("--ahead", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--data-dir", default=os.path.join(os.path.dirname(__file__), "..", "bench_data")
    )
    args = ap.parse_args()
    cfg = config(bamba_corpus(args.data_dir, args.tokens))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=2)
        for step, _ in enumerate(loader, 1):
            if step == SAVED:
                save_checkpoint(loader, ckpt)
                break
        loader.close()
        times: dict[str, list[float]] = {
            "loader, 2 workers": [], "pipeline": [], "replay": [], "replay 1 step": [],
        }  # fmt: skip
        for _ in range(args.repeat):
            times["replay 1 step"].append(replay_time(cfg, ckpt, 1))
            times["loader, 2 workers"].append(loader_time(cfg, ckpt, 2, args.ahead))
            times["pipeline"].append(pipeline_time(cfg, ckpt, args.ahead))
            times["replay"].append(replay_time(cfg, ckpt, args.ahead))
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.ahead * cfg.batch_size * (cfg.seq_length + 1)
    print(f"{args.ahead} steps ahead of a checkpoint ({tokens / 1e6:.1f} M tokens), "
          f"median of {args.repeat}:")  # fmt: skip
    for k, v in med.items():
        print(f"  {k:<18} {v:7.2f} s")
    for k in ("loader, 2 workers", "pipeline"):
        print(f"  replay / {k}: {med['replay'] / med[k]:.2f}")


if __name__ == "__main__":
    main()
