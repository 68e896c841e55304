"""Pipeline throughput: packed batches per second from the full Bamba-style pipeline.

Three weighted sources (3:1:1) of pre-tokenized Arrow (Bamba layout, lognormal document
lengths with a median of ~600 tokens and a tail to 100k), seq_len 4096, batch 8, shuffle
buffer 10,000 sequences, one process. Reported next to the raw limit measured in the same run
(memory-map every file, take each record batch's column zero-copy, concatenate with NumPy),
and the same for JSONL text through the byte tokenizer.

    python benchmarks/pipeline_throughput.py [--tokens 150_000_000] [--text-bytes 20_000_000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _corpus import arrow_dataset, jsonl_dataset  # noqa: E402

from torchdata_ext import World  # noqa: E402
from torchdata_ext.pipeline import PipelineConfig, build_datasets, build_pipeline  # noqa: E402


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


def pipeline_pass(cfg: PipelineConfig, max_tokens: int) -> tuple[int, float, int]:
    datasets = build_datasets(cfg)
    node = build_pipeline(cfg, World(), datasets)
    t0 = time.perf_counter()
    tokens = batches = 0
    for batch in node:
        tokens += batch["input_ids"].numel()
        batches += 1
        if tokens >= max_tokens:
            break
    return tokens, time.perf_counter() - t0, batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=150_000_000, help="corpus size (tokens)")
    p.add_argument("--text-bytes", type=int, default=20_000_000)
    p.add_argument("--data-dir", default="bench_data/pipeline")
    p.add_argument("--shuffle-buffer", type=int, default=10_000)
    p.add_argument("--pack-mode", default="concat")
    args = p.parse_args()

    root = os.path.join(args.data_dir, f"arrow_{args.tokens}")
    shares = {"web": 0.6, "code": 0.2, "books": 0.2}
    for i, (name, share) in enumerate(shares.items()):
        arrow_dataset(os.path.join(root, name), int(args.tokens * share), 4, seed=i)
    cfg = PipelineConfig(
        data_path=root, datasets=list(shares), weights=[3, 1, 1], seq_length=4096, batch_size=8,
        shuffle_buffer=args.shuffle_buffer, logical_shards=256, eos_token=0, block_docs=256,
        pack_mode=args.pack_mode, dtype="int32",
    )  # fmt: skip
    files = [f for ix in build_datasets(cfg).values() for f in ix.files]
    n_raw, t_raw = raw_limit(files)
    # deliver as many tokens as the corpus holds (the buffer fill is part of the cost)
    n_pipe, t_pipe, batches = pipeline_pass(cfg, int(args.tokens * 0.9))
    raw_rate, pipe_rate = n_raw / t_raw, n_pipe / t_pipe
    print(f"raw limit (mmap + zero-copy + np.concatenate): {raw_rate / 1e6:8.1f}M tokens/s")
    print(
        f"pipeline, pre-tokenized Arrow, 3 sources, seq 4096 x batch 8, shuffle {args.shuffle_buffer}:"
        f" {pipe_rate / 1e6:8.1f}M tokens/s ({batches} batches)"
    )
    print(f"ratio pipeline / raw: {pipe_rate / raw_rate:.2f}")

    troot = os.path.join(args.data_dir, f"jsonl_{args.text_bytes}")
    jsonl_dataset(os.path.join(troot, "prose"), args.text_bytes, 4, seed=7)
    tcfg = PipelineConfig(
        data_path=troot, datasets=["prose"], file_type="jsonl", col_name="text", tokenizer="byte",
        seq_length=4096, batch_size=8, shuffle_buffer=min(args.shuffle_buffer, 1000),
        logical_shards=64, eos_token=10, block_docs=256, dtype="int32",
    )  # fmt: skip
    t0 = time.perf_counter()
    nbytes = sum(os.path.getsize(f) for ix in build_datasets(tcfg).values() for f in ix.files)
    n_text, t_text, _ = pipeline_pass(tcfg, int(args.text_bytes * 0.8))
    print(f"pipeline, JSONL text + byte tokenizer: {n_text / t_text / 1e6:8.1f}M tokens/s")
    print(
        f"  (corpus {nbytes / 1e6:.0f} MB; ratio to the Arrow pipeline: {(n_text / t_text) / pipe_rate:.2f})"
    )
    del t0


if __name__ == "__main__":
    main()
