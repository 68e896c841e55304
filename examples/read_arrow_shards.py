"""Read a folder of Arrow token shards with torchdata-ext, checkpoint mid-epoch, resume.

Run with no arguments to generate a small Bamba-layout dataset (one document per Arrow
record batch, ``tokens`` column) in a temporary folder and read it; or point ``--data`` at your
own folder (any fsspec URL) of ``.arrow`` / ``.parquet`` / ``.npy`` / ``.jsonl`` shards.

What it shows and checks:

1. ``DatasetIndex.build`` lists the shard files and counts their documents (kept in
   ``meta/torchdata_ext_counts.csv`` so the next start does not open every file);
2. ``ShardReader`` cuts the documents into logical shards and walks them in random order, here
   as 2 dataloader-style workers, each wrapped in a ``torchdata.nodes.Loader``;
3. halfway through the epoch the loaders' states are saved (pickled, as a checkpoint would),
   new loaders are built from them, and the epoch is finished;
4. every document was delivered exactly once.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import tempfile
import time

import numpy as np
from torchdata.nodes import Loader

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.testing import write_arrow_batches


def make_demo_dataset(folder: str, n_files: int = 4, docs_per_file: int = 2_000) -> None:
    """Write ``n_files`` Arrow shards of random documents (lognormal lengths, median ~600)."""
    rng = np.random.default_rng(0)
    for f in range(n_files):
        lengths = np.clip(rng.lognormal(np.log(600), 0.9, docs_per_file), 8, 20_000).astype(int)
        docs = [rng.integers(3, 50_000, n, dtype=np.uint32) for n in lengths]
        write_arrow_batches(f"{folder}/shard_{f:03d}.arrow", docs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="folder or URL of shards (default: generate a demo set)")
    parser.add_argument("--logical-shards", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            data = f"{tmp}/web"
            make_demo_dataset(data)
            print(f"generated a demo dataset in {data}")
        index = DatasetIndex.build(data)
        print(
            f"dataset {index.name!r}: {len(index.files)} files, {index.total_docs:,} documents, "
            f"{index.total_tokens:,} tokens"
        )

        def loader(worker: int) -> Loader:
            world = World(rank=0, world_size=1, worker_id=worker, num_workers=args.workers)
            reader = ShardReader(
                index, args.logical_shards, seed=args.seed, world=world, epochs=1, block_docs=64
            )
            return Loader(reader, restart_on_stop_iteration=False)

        seen: collections.Counter = collections.Counter()
        tokens = 0
        start = time.perf_counter()
        # first half of the epoch, then a checkpoint
        checkpoint = []
        for w in range(args.workers):
            ld = loader(w)
            it = iter(ld)
            for _ in range(index.total_docs // (64 * args.workers * 2)):
                block = next(it)
                tokens += block.num_tokens
                seen.update(zip(block.file.tolist(), block.doc.tolist()))
            checkpoint.append(pickle.dumps(ld.state_dict()))
        print(
            f"checkpoint after {sum(seen.values()):,} documents: {sum(map(len, checkpoint)):,} bytes"
        )
        # a new job restores from the checkpoint and finishes the epoch
        for w in range(args.workers):
            ld = loader(w)
            ld.load_state_dict(pickle.loads(checkpoint[w]))
            for block in ld:
                tokens += block.num_tokens
                seen.update(zip(block.file.tolist(), block.doc.tolist()))
        elapsed = time.perf_counter() - start

    repeated = sum(1 for n in seen.values() if n > 1)
    missing = index.total_docs - len(seen)
    print(f"read {tokens:,} tokens in {elapsed:.2f}s ({tokens / elapsed / 1e6:.1f}M tokens/s)")
    print(f"documents delivered: {len(seen):,}; repeated: {repeated}; missing: {missing}")
    if repeated or missing:
        raise SystemExit("FAILED: the epoch did not deliver every document exactly once")
    print("OK: every document exactly once across the checkpoint and restore")


if __name__ == "__main__":
    main()
