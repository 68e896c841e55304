"""A stand-in training loop for the kill test: iterate, log what was delivered, checkpoint.

usage: python _train_loop.py DATA CKPT LOG WORKERS CKPT_EVERY [--resume] [--pipeline]

Each step's delivery is appended to LOG as "step item item ...", flushed and fsynced, so
whatever was logged survives a SIGKILL: with the reader alone an item is a document's first
token (its id); with ``--pipeline`` (DATA holds ``web/`` and ``code/``: interleave 2:1, pack,
shuffle buffer) an item is a provenance row ``dataset,file,doc,start,length`` of the packed
sequence. Every CKPT_EVERY steps the loader state is saved to CKPT/step_<n> (atomically; the
manifest is written last) and "CHECKPOINT n" is logged.
"""

from __future__ import annotations

import functools
import os
import sys

from torchdata.nodes import BaseNode

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig


def build_reader(root: str, world: World) -> ShardReader:
    return ShardReader(DatasetIndex.build(root), 16, world=world, epochs=1, block_docs=3, seed=4)


def full_config(root: str) -> PipelineConfig:
    """The ``--pipeline`` config (the kill test audits its checkpoints with it)."""
    return PipelineConfig(
        data_path=root, datasets="web,code", weights="2,1", seq_length=16, eos_token=0,
        logical_shards=12, shuffle_buffer=4, block_docs=3, epochs=1, mix_quantum_tokens=0,
        seed=4,
    )  # fmt: skip


def build_full(root: str, world: World) -> BaseNode:
    return build_pipeline(full_config(root), world, collate=False)


def items(out, pipeline: bool) -> list[str]:
    if not pipeline:
        return [str(int(d.data[0])) for d in out]
    rows = out["provenance"].tolist()
    return [",".join(map(str, r)) for r in rows if r[0] >= 0 and r[4] > 0]


def main() -> None:
    data, ckpt, log, workers, every = sys.argv[1:6]
    resume = "--resume" in sys.argv
    pipeline = "--pipeline" in sys.argv
    build = build_full if pipeline else build_reader
    loader = TokenLoader(functools.partial(build, data), num_workers=int(workers))
    step = 0
    if resume:
        done = sorted(
            int(d.split("_")[1])
            for d in os.listdir(ckpt)
            if os.path.exists(os.path.join(ckpt, d, "manifest.json"))
        )
        step = done[-1]
        load_checkpoint(loader, os.path.join(ckpt, f"step_{step}"))
    with open(log, "a") as f:
        f.write(f"RESUME {step}\n" if resume else "START 0\n")
        for out in loader:
            step += 1
            f.write(f"{step} {' '.join(items(out, pipeline))}\n")
            f.flush()
            os.fsync(f.fileno())
            if step % int(every) == 0:
                save_checkpoint(loader, os.path.join(ckpt, f"step_{step}"))
                f.write(f"CHECKPOINT {step}\n")
                f.flush()
        f.write("END\n")


if __name__ == "__main__":
    main()
