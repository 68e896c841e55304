"""A stand-in training loop for the kill test: iterate, log delivered documents, checkpoint.

usage: python _train_loop.py DATA CKPT LOG WORKERS CKPT_EVERY [--resume]

Each batch's document ids are appended to LOG as "step id id ...", flushed and fsynced, so
whatever was logged survives a SIGKILL. Every CKPT_EVERY steps the loader state is saved to
CKPT/step_<n> (atomically; the manifest is written last) and "CHECKPOINT n" is logged.
"""

from __future__ import annotations

import functools
import os
import sys

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.checkpoint import load_checkpoint, save_checkpoint
from torchdata_ext.loader import TokenLoader


def build(root: str, world: World) -> ShardReader:
    return ShardReader(DatasetIndex.build(root), 16, world=world, epochs=1, block_docs=3, seed=4)


def main() -> None:
    data, ckpt, log, workers, every = sys.argv[1:6]
    resume = "--resume" in sys.argv
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
        for block in loader:
            step += 1
            ids = [str(int(d.data[0])) for d in block]
            f.write(f"{step} {' '.join(ids)}\n")
            f.flush()
            os.fsync(f.fileno())
            if step % int(every) == 0:
                save_checkpoint(loader, os.path.join(ckpt, f"step_{step}"))
                f.write(f"CHECKPOINT {step}\n")
                f.flush()
        f.write("END\n")


if __name__ == "__main__":
    main()
