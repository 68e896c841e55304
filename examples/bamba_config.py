"""IBM Bamba's data pipeline, as its config sets it, on a generated Arrow dataset.

Bamba's data is Arrow IPC shards of Llama-3 token ids, one document per record batch in a
``tokens`` column, under ``data_path/<dataset>/``. Its dataloader config is the dataclass below
(fields as in Bamba's release notes); :class:`~torchdata_ext.pipeline.config.PipelineConfig` takes the
same fields with the same meaning, and :func:`~torchdata_ext.pipeline.build.build_pipeline` builds the
node graph they describe. Run with no arguments::

    python examples/bamba_config.py

It writes a small dataset of two sub-datasets in a temporary folder, builds the pipeline under a
``TokenLoader`` with the config's workers, prints a batch's tensor shapes and the size of the
loader state a checkpoint would hold.
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import tempfile
import time

import numpy as np
from torchdata.nodes import BaseNode

from torchdata_ext import PipelineConfig, TokenLoader, World, build_pipeline
from torchdata_ext.testing import write_arrow_batches


def bamba_config(data_path: str) -> PipelineConfig:
    """Bamba's values; where Bamba's release left a TODO, a small value for this demo."""
    return PipelineConfig(
        # -- sources: DatasetIndex + the Arrow file handler ------------------------------------
        data_path=data_path,  # folder (any fsspec URL) with one sub-folder per dataset
        file_type="arrow",  # ArrowHandler: Arrow IPC, one document per record batch
        col_name="tokens",  # the column holding each document's token ids
        datasets="web,code",  # sub-folders = sub-datasets (Bamba: TODO in its release)
        # -- Interleave: mix of sub-datasets, counted in tokens --------------------------------
        weights="3,1",  # relative weights (Bamba: TODO)
        # -- Pack: concatenate documents and cut into sequences ---------------------------------
        seq_length=4096,  # tokens per input_ids row (packs 4097 for the shifted labels)
        bos_token=None,  # no BOS added at document starts
        eos_token=0,  # EOS (Llama-3 id 0 here) added at every document end where missing
        bol_token=None,  # nothing added at the start of each sequence ("line")
        eol_token=None,  # nothing added at the end of each sequence
        # -- ShardReader: document cleaning, logical shards, random walk ----------------------
        strip_tokens="",  # token ids stripped from document ends before the above (none)
        logical_shards=64,  # logical shards per dataset, >= ranks x workers (Bamba: TODO)
        seed=42,  # random walk, file/shard order, interleave, shuffle buffer (Bamba: TODO)
        # -- ShuffleBuffer: mixes packed sequences ----------------------------------------------
        shuffle_buffer=64,  # Bamba used 10,000 sequences; small here for a quick first batch
        # -- Collate + TokenLoader (StatefulDataLoader) ---------------------------------------
        batch_size=2,  # sequences per batch (Bamba: TODO)
        num_workers=2,  # dataloader worker processes per rank (Bamba: TODO)
    )


def make_dataset(root: str, files_per_dataset: int = 3, docs_per_file: int = 200) -> None:
    """Random uint32 token documents (ids 1..128255, lognormal lengths) in the Bamba layout."""
    rng = np.random.default_rng(0)
    for name in ("web", "code"):
        for f in range(files_per_dataset):
            lengths = np.clip(rng.lognormal(np.log(800), 1.0, docs_per_file), 4, 30_000)
            docs = [rng.integers(1, 128_256, int(n), dtype=np.uint32) for n in lengths]
            write_arrow_batches(os.path.join(root, name, f"shard_{f:03d}.arrow"), docs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=4, help="batches to read")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bamba_") as tmp:
        make_dataset(tmp)
        cfg = bamba_config(tmp)
        build = functools.partial(_build, cfg)
        loader = TokenLoader(build, num_workers=cfg.num_workers)
        t0 = time.perf_counter()
        it = iter(loader)
        batch = next(it)
        for _ in range(args.batches - 1):
            next(it)
        elapsed = time.perf_counter() - t0
        for key, value in batch.items():
            print(f"batch[{key!r}]: {tuple(value.shape)} {value.dtype}")
        state = pickle.dumps(loader.state_dict())
        print(f"read {args.batches} batches in {elapsed:.2f}s")
        print(f"loader state: {len(state):,} bytes for {cfg.num_workers} workers")
        for key in ("input_ids", "labels"):
            if tuple(batch[key].shape) != (cfg.batch_size, cfg.seq_length):
                raise SystemExit(f"FAILED: batch[{key!r}] has shape {tuple(batch[key].shape)}")
        print(f"OK: Bamba pipeline batch of {cfg.batch_size} x {cfg.seq_length} tokens")


def _build(cfg: PipelineConfig, world: World) -> BaseNode:
    return build_pipeline(cfg, world)


if __name__ == "__main__":
    main()
