"""Pipeline throughput: packed batches per second from the full Bamba-style pipeline.

Three weighted sources (3:1:1) of pre-tokenized Arrow (Bamba layout, lognormal document
lengths with a median of ~600 tokens and a tail to 100k), seq_len 4096, batch 8, shuffle
buffer 10,000 sequences, one process. Reported next to the raw limit measured in the same run
(memory-map every file, take each record batch's column zero-copy, concatenate with NumPy),
and the same for JSONL text through the byte tokenizer.

    python benchmarks/pipeline_throughput.py [--tokens 150_000_000] [--text-bytes 20_000_000]
        [--repeat 3] [--loader-batches 1000]

The same pipeline with ``strip_tokens=[0]`` (what Bamba's config and fms-fsdp set; the corpus has
nothing to strip, so this is the check's cost alone) runs alternately with it, and its ratio
to the pipeline without stripping is printed.

It also runs the pipeline through ``TokenLoader`` as a training loop does, with
``state_dict()`` at every step: in a background thread and in 1 or 2 dataloader worker
processes, each next to the bare pipeline's rate after its buffer fill (``benchmarks/
loader_overhead.py`` adds a simulated training step), and the bare pipeline taking its graph
state after every batch (the state's own cost, without a loader). The 2-worker path runs
twice: with the tokens in shared-memory slots (the default) and in the messages
(``shared_tokens=False``, how they travelled before), so the slots' gain is measured in the
same run.

The machine may be shared: ``--repeat`` runs the raw limit and the pipeline alternately that
many times and reports the best and the median of each, and the ratio of the bests (compare
ratios between runs, not absolute figures). The CPU-time rate (process time, which other
processes disturb less than wall time) is printed next to the wall-time rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _corpus import BAMBA_SHARES, bamba_corpus, jsonl_dataset  # noqa: E402
from _cpu import tree_cpu  # noqa: E402

from torchdata_ext import World  # noqa: E402
from torchdata_ext.pipeline.build import build_datasets, build_pipeline  # noqa: E402
from torchdata_ext.pipeline.config import PipelineConfig  # noqa: E402


def raw_limit(files: list[str]) -> tuple[int, float]:
    import numpy as np

    t0 = time.perf_counter()
    total = 0
    for path in files:
        with pa.memory_map(path) as source:
            reader = pa.ipc.open_file(source)
            cols = [
                reader.get_batch(i).column(0).to_numpy(zero_copy_only=True)
                for i in range(reader.num_record_batches)
            ]
            total += len(np.concatenate(cols))
    return total, time.perf_counter() - t0


def pipeline_pass(cfg: PipelineConfig, max_tokens: int) -> tuple[int, float, int, float, float]:
    """Tokens delivered, wall seconds, batches, CPU seconds, seconds to the first batch (the
    shuffle buffer's fill)."""
    datasets = build_datasets(cfg)
    node = build_pipeline(cfg, World(), datasets)
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = batches = 0
    first = 0.0
    for batch in node:
        if not batches:
            first = time.perf_counter() - t0
        tokens += batch["input_ids"].numel()
        batches += 1
        if tokens >= max_tokens:
            break
    return tokens, time.perf_counter() - t0, batches, time.process_time() - c0, first


def loader_rates(cfg: PipelineConfig, n_batches: int, repeat: int) -> None:
    """The same pipeline through ``TokenLoader`` as a training loop takes it, with
    ``state_dict()`` called at every step: in a background thread of this process and in 1 or 2
    StatefulDataLoader worker processes (after the first batches and, with a streaming buffer,
    the first ``shuffle_buffer`` draws per worker, so the buffer fill is left out). Each path's
    reference is the bare pipeline over the same number of batches after its fill, measured alternately with the paths, ``repeat`` rounds; ratios of the bests."""
    import functools

    from torchdata_ext.loader.token_loader import TokenLoader

    datasets = build_datasets(cfg)
    paths = (
        ("in-process thread", 0, True),
        ("1 worker process", 1, True),
        ("2 worker processes", 2, True),
        # the reference for the shared-memory token slots: tokens in the messages, as before
        ("2 worker processes, tokens in the messages", 2, False),
    )

    def fill(workers: int) -> int:  # batches until a streaming buffer is full in every worker
        if cfg.shuffle_fill != "stream":
            return 0
        return -(-cfg.shuffle_buffer * max(1, workers) // cfg.batch_size)

    bares: list[float] = []
    stated: list[float] = []  # the bare pipeline with its graph state taken after every batch
    rates: dict[str, list[float]] = {label: [] for label, _, _ in paths}
    cpu: dict[str, list[float]] = {label: [] for label, _, _ in paths}  # CPU s per M tokens
    for _ in range(max(1, repeat)):
        for with_state, out in ((False, bares), (True, stated)):
            node = build_pipeline(cfg, World(), datasets)
            for _ in range(1 + fill(0)):
                next(node)
            t0 = time.perf_counter()
            tokens = 0
            for _ in range(n_batches):
                tokens += next(node)["input_ids"].numel()
                if with_state:
                    node.state_dict()
            out.append(tokens / (time.perf_counter() - t0))
            del node
        for label, workers, shared in paths:
            loader = TokenLoader(
                functools.partial(_build, cfg, datasets), num_workers=workers, shared_tokens=shared
            )
            it = iter(loader)
            for _ in range(fill(workers) + 5 * max(1, workers)):
                next(it)
            t0, c0 = time.perf_counter(), tree_cpu()
            tokens = 0
            for _ in range(n_batches):
                tokens += next(it)["input_ids"].numel()
                loader.state_dict()
            rates[label].append(tokens / (time.perf_counter() - t0))
            cpu[label].append((tree_cpu() - c0) / tokens * 1e6)
            del it, loader
    bare = max(bares)
    print(
        f"bare pipeline, {n_batches} batches after its fill: {_summary(bares)} (the reference "
        "of the TokenLoader rows)"
    )
    print(
        f"bare pipeline taking its graph state after every batch: {_summary(stated)} (ratio "
        f"of the bests {max(stated) / bare:.2f}; of the medians "
        f"{statistics.median(stated) / statistics.median(bares):.2f})"
    )
    for label, got in rates.items():
        print(
            f"TokenLoader, {label}, state every step: {_summary(got)} (ratio of the bests to "
            f"the bare pipeline {max(got) / bare:.2f}; of the medians "
            f"{statistics.median(got) / statistics.median(bares):.2f}); CPU seconds per "
            f"million tokens, this process and its workers: {min(cpu[label]):.3f} (least of "
            f"{len(cpu[label])})"
        )


def _build(cfg: PipelineConfig, datasets, world: World):
    return build_pipeline(cfg, world, datasets)


def _summary(rates: list[float]) -> str:
    best, median = max(rates), statistics.median(rates)
    if len(rates) == 1:
        return f"{best / 1e6:8.1f}M tokens/s"
    return (
        f"{best / 1e6:8.1f}M tokens/s (best of {len(rates)}; median {median / 1e6:.1f}M, "
        f"first {rates[0] / 1e6:.1f}M)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=150_000_000, help="corpus size (tokens)")
    p.add_argument("--text-bytes", type=int, default=20_000_000)
    p.add_argument("--data-dir", default="bench_data/pipeline")
    p.add_argument("--shuffle-buffer", type=int, default=10_000)
    p.add_argument("--pack-mode", default="concat")
    p.add_argument("--repeat", type=int, default=3, help="alternating runs; best and median")
    p.add_argument(
        "--loader-batches", type=int, default=1000,
        help="batches per TokenLoader measurement (0 skips them)",
    )  # fmt: skip
    args = p.parse_args()

    root = bamba_corpus(args.data_dir, args.tokens)
    shares = BAMBA_SHARES
    cfg = PipelineConfig(
        data_path=root, datasets=list(shares), weights=[3, 1, 1], seq_length=4096, batch_size=8,
        shuffle_buffer=args.shuffle_buffer, logical_shards=256, eos_token=0, block_docs=256,
        pack_mode=args.pack_mode, dtype="int32",
    )  # fmt: skip
    files = [f for ix in build_datasets(cfg).values() for f in ix.files]
    raw_rates: list[float] = []
    pipe_rates: list[float] = []
    cpu_rates: list[float] = []
    steady_rates: list[float] = []
    fills: list[float] = []
    strip_rates: list[float] = []
    strip_cfg = PipelineConfig(**{**cfg.to_dict(), "strip_tokens": [0]})
    batches = 0
    for _ in range(max(1, args.repeat)):
        n_raw, t_raw = raw_limit(files)
        raw_rates.append(n_raw / t_raw)
        # deliver as many tokens as the corpus holds (the buffer fill is part of the cost)
        n_pipe, t_pipe, batches, c_pipe, first = pipeline_pass(cfg, int(args.tokens * 0.9))
        pipe_rates.append(n_pipe / t_pipe)
        cpu_rates.append(n_pipe / c_pipe)
        steady_rates.append(n_pipe * (batches - 1) / batches / (t_pipe - first))
        fills.append(first)
        n_strip, t_strip, _, _, _ = pipeline_pass(strip_cfg, int(args.tokens * 0.9))
        strip_rates.append(n_strip / t_strip)
    raw_rate, pipe_rate = max(raw_rates), max(pipe_rates)
    print(f"raw limit (mmap + zero-copy + np.concatenate): {_summary(raw_rates)}")
    print(
        f"pipeline, pre-tokenized Arrow, 3 sources, seq 4096 x batch 8, shuffle {args.shuffle_buffer}:"
        f" {_summary(pipe_rates)} ({batches} batches)"
    )
    print(f"  per CPU second: {_summary(cpu_rates)}")
    print(
        f"  after the first batch: {_summary(steady_rates)}; first batch (buffer fill) after "
        f"{min(fills):.2f}-{max(fills):.2f} s"
    )
    print(f"ratio pipeline / raw (bests): {pipe_rate / raw_rate:.2f}")
    print(
        f"same with strip_tokens=[0]: {_summary(strip_rates)}; ratio to no stripping (bests) "
        f"{max(strip_rates) / pipe_rate:.3f}, (medians) "
        f"{statistics.median(strip_rates) / statistics.median(pipe_rates):.3f}"
    )

    if args.loader_batches:
        loader_rates(cfg, args.loader_batches, args.repeat)

    troot = os.path.join(args.data_dir, f"jsonl_{args.text_bytes}")
    jsonl_dataset(os.path.join(troot, "prose"), args.text_bytes, 4, seed=7)
    tcfg = PipelineConfig(
        data_path=troot, datasets=["prose"], file_type="jsonl", col_name="text", tokenizer="byte",
        seq_length=4096, batch_size=8, shuffle_buffer=min(args.shuffle_buffer, 1000),
        logical_shards=64, eos_token=0, block_docs=256, dtype="int32",
    )  # fmt: skip
    t0 = time.perf_counter()
    nbytes = sum(os.path.getsize(f) for ix in build_datasets(tcfg).values() for f in ix.files)
    n_text, t_text, _, _, _ = pipeline_pass(tcfg, int(args.text_bytes * 0.8))
    print(f"pipeline, JSONL text + byte tokenizer: {n_text / t_text / 1e6:8.1f}M tokens/s")
    print(
        f"  (corpus {nbytes / 1e6:.0f} MB; ratio to the Arrow pipeline: {(n_text / t_text) / pipe_rate:.2f})"
    )
    del t0


if __name__ == "__main__":
    main()
