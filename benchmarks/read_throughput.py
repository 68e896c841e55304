"""Reader throughput: tokens/s of ShardReader over a generated Arrow dataset vs the raw limit.

The dataset is Bamba's layout (one document per Arrow record batch, ``tokens`` column, uint32),
``--tokens`` tokens (default 100M) in ``--files`` files, document lengths lognormal with a median
of ~600 tokens and a long tail. It is generated once into ``--data-dir`` (default
``bench_data/read_throughput``, git-ignored) and reused.

The reference, measured in the same run: the raw limit of getting those tokens into one NumPy
buffer per file: memory-map each file, take every record batch's column zero-copy, and
concatenate with NumPy. The reader does that plus sharding, random-walk order and provenance.

    python benchmarks/read_throughput.py [--tokens 100_000_000] [--block-docs 256]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import pyarrow as pa

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.testing import write_arrow_batches


def generate(folder: str, total_tokens: int, n_files: int, seed: int = 0) -> None:
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_file = total_tokens // n_files
    for f in range(n_files):
        path = os.path.join(folder, f"shard_{f:04d}.arrow")
        if os.path.exists(path):
            continue
        lengths: list[int] = []
        while sum(lengths) < per_file:
            chunk = np.clip(rng.lognormal(np.log(600), 1.0, 4096), 16, 100_000).astype(np.int64)
            lengths.extend(chunk.tolist())
        lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), per_file)) + 1]
        flat = rng.integers(0, 128_000, size=sum(lengths), dtype=np.uint32)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        docs = [flat[bounds[i] : bounds[i + 1]] for i in range(len(lengths))]
        write_arrow_batches(path + ".tmp", docs)
        os.replace(path + ".tmp", path)


def raw_limit(files: list[str]) -> tuple[int, float]:
    t0 = time.perf_counter()
    total = 0
    for path in files:
        with pa.memory_map(path) as source:
            reader = pa.ipc.open_file(source)
            cols = [
                reader.get_batch(i).column(0).to_numpy(zero_copy_only=True)
                for i in range(reader.num_record_batches)
            ]
            out = np.concatenate(cols)
            total += len(out)
    return total, time.perf_counter() - t0


def reader_pass(index: DatasetIndex, shards: int, block_docs: int) -> tuple[int, float]:
    reader = ShardReader(index, shards, world=World(), epochs=1, block_docs=block_docs)
    t0 = time.perf_counter()
    total = 0
    for block in reader:
        total += block.num_tokens
    return total, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=100_000_000)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--logical-shards", type=int, default=1024)
    p.add_argument("--block-docs", type=int, default=256)
    p.add_argument("--data-dir", default="bench_data/read_throughput")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()

    folder = os.path.join(args.data_dir, f"{args.tokens}")
    generate(folder, args.tokens, args.files)
    index = DatasetIndex.build(folder)
    print(
        f"dataset: {len(index.files)} files, {index.total_docs:,} docs, {index.total_tokens:,} tokens"
    )
    raw_best = rd_best = float("inf")
    for _ in range(args.repeats):  # alternate, best of N, so page cache warms both equally
        n_raw, t_raw = raw_limit(list(index.files))
        n_rd, t_rd = reader_pass(index, args.logical_shards, args.block_docs)
        assert n_raw == n_rd == index.total_tokens, (n_raw, n_rd, index.total_tokens)
        raw_best, rd_best = min(raw_best, t_raw), min(rd_best, t_rd)
    raw_rate = index.total_tokens / raw_best
    rd_rate = index.total_tokens / rd_best
    print(f"raw limit (mmap + zero-copy + np.concatenate): {raw_rate / 1e6:8.1f}M tokens/s")
    print(
        f"ShardReader ({args.logical_shards} shards, block_docs={args.block_docs}):"
        f" {rd_rate / 1e6:8.1f}M tokens/s"
    )
    print(f"ratio reader / raw: {rd_rate / raw_rate:.2f}")


if __name__ == "__main__":
    main()
