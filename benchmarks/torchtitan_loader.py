"""This project's torchtitan loader vs torchtitan's own HF text loader, on the same local text.

Both read the same JSONL files (two datasets), tokenize with the same byte tokenizer into rows
of ``--seq-len`` tokens, batches of 8, in this process (0 workers). Printed for each: tokens/s
over ``--batches`` batches, the size of its DCP state (what ``CheckpointManager`` stores under
``"dataloader"``), the time to restore it and deliver the first batch, and what it does when
the checkpoint was taken at dp 2 and is loaded at dp 3. torchtitan's side is its weighted
``InterleavedHuggingFaceTextDataLoader`` over the same two datasets, weights 1:1 (it mixes
packed rows of each source by weight; ours mixes documents by tokens).

    PYTHONPATH=. python benchmarks/torchtitan_loader.py [--batches 100] [--docs 2000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from typing import Any

import numpy as np
import torch.distributed.checkpoint as dcp

from torchdata_ext.testing import write_jsonl
from torchdata_ext.tokenizers.load import DEFAULT_BYTE_OFFSET
from torchdata_ext.torchtitan import TokenDataLoader

WORDS = ["the", "a", "loader", "shard", "token", "model", "data", "epoch", "rank", "worker"]


class _ByteTokenizer:
    """torchtitan's tokenizer interface over the byte tokenizer this project uses."""

    eos_id, bos_id = 0, 257

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = [b + DEFAULT_BYTE_OFFSET for b in text.encode()]
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos


def _corpus(root: str, docs: int) -> None:
    rng = np.random.default_rng(0)
    for name in ("web", "code"):
        texts = [" ".join(rng.choice(WORDS, 5 + int(rng.exponential(80)))) for _ in range(docs)]
        for f in range(4):
            write_jsonl(f"{root}/{name}/part{f}.jsonl", texts[f::4])


def _ours(root: str, dp: int, rank: int, seq_len: int) -> TokenDataLoader:
    config = TokenDataLoader.Config(
        fields={
            "data_path": root, "datasets": "web,code", "weights": "1,1", "file_type": "jsonl",
            "col_name": "text", "tokenizer": "byte", "bos_token": 257, "eos_token": 0,
            "logical_shards": 64, "shuffle_buffer": 64, "seed": 1,
        }
    )  # fmt: skip
    return config.build(
        dp_world_size=dp, dp_rank=rank, tokenizer=None, seq_len=seq_len, local_batch_size=8
    )


def _theirs(root: str, dp: int, rank: int, seq_len: int) -> Any:
    from torchtitan.hf_datasets.text_datasets import (
        HFDataSource,
        InterleavedHuggingFaceTextDataLoader,
    )

    config = InterleavedHuggingFaceTextDataLoader.Config(
        sources=[
            HFDataSource(dataset="c4_test", dataset_path=f"{root}/{name}", weight=1.0)
            for name in ("web", "code")
        ]
    )
    return config.build(
        dp_world_size=dp, dp_rank=rank, tokenizer=_ByteTokenizer(), seq_len=seq_len,
        local_batch_size=8,
    )  # fmt: skip


def _rate(loader: Any, batches: int) -> tuple[float, Any]:
    it = iter(loader)
    next(it)  # the first batch (buffers filling) is not counted
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(batches):
        _, labels = next(it)
        tokens += labels.numel()
    return tokens / (time.perf_counter() - t0), it


def _dcp_round(make: Any, folder: str) -> tuple[int, float, str]:
    """Save at dp 1 after some batches, reload at dp 1 (timed), then try dp 3 (rank 0)."""
    loader = make(1, 0)
    it = iter(loader)
    for _ in range(20):
        next(it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"dataloader": loader}, checkpoint_id=folder)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        fresh = make(1, 0)
        t0 = time.perf_counter()
        dcp.load({"dataloader": fresh}, checkpoint_id=folder)
        next(iter(fresh))
        restore = time.perf_counter() - t0
        other = make(3, 0)
        try:
            dcp.load({"dataloader": other}, checkpoint_id=folder)
            next(iter(other))
            outcome = "restores (rescaled)"
        except Exception as exc:  # what torchtitan's own loader does
            outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
    return size, restore, outcome


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--docs", type=int, default=2000)
    p.add_argument("--seq-len", type=int, default=512)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("HF_DATASETS_CACHE", f"{tmp}/hf_cache")  # before datasets loads
        _corpus(f"{tmp}/data", args.docs)
        rows = []
        for name, make in (
            ("torchdata-ext TokenDataLoader", lambda dp, r: _ours(f"{tmp}/data", dp, r, args.seq_len)),
            ("torchtitan InterleavedHuggingFaceTextDataLoader", lambda dp, r: _theirs(f"{tmp}/data", dp, r, args.seq_len)),
        ):  # fmt: skip
            rate, _ = _rate(make(1, 0), args.batches)
            size, restore, outcome = _dcp_round(make, f"{tmp}/{len(rows)}")
            rows.append((name, rate, size, restore, outcome))
        for name, rate, size, restore, outcome in rows:
            print(f"{name}: {rate / 1e6:.2f} M tokens/s; DCP state {size / 1e3:.1f} KB; "
                  f"restore + first batch {restore * 1e3:.0f} ms; dp 1 -> 3: {outcome}")  # fmt: skip
        print(f"ratio (ours / torchtitan's): {rows[0][1] / rows[1][1]:.2f}x tokens/s, "
              f"{rows[0][2] / rows[1][2]:.2f}x state size, {rows[0][3] / rows[1][3]:.2f}x restore time")  # fmt: skip


if __name__ == "__main__":
    main()
