"""A trainer that stops taking batches and waits to be killed (test_orphan_workers.py).

usage: python _orphan_trainer.py DATA CONTEXT [TOKENS]

Its 2 workers keep preparing batches of 4 x 16,385 int64 tokens sent in the messages (no
shared-memory ring), so the dataloader's pipe fills while the trainer sleeps: the state in
which a worker whose trainer was SIGKILLed used to wait forever on a pipe nobody reads.
TOKENS ``ring``: in the shared-memory ring instead (the default; each worker then keeps a
socket in its multiprocessing temporary folder, which a killed worker must remove itself).
"""

from __future__ import annotations

import functools
import os
import sys
import time

from torchdata_ext import PipelineConfig, TokenLoader, build_pipeline


def main() -> None:
    data, context = sys.argv[1:3]
    ring = sys.argv[3:4] == ["ring"]
    cfg = PipelineConfig(
        data_path=data, datasets="web", seq_length=16_384, batch_size=4, logical_shards=4,
        shuffle_buffer=1,
    )  # fmt: skip
    loader = TokenLoader(
        functools.partial(build_pipeline, cfg),
        num_workers=2,
        shared_tokens=ring,
        multiprocessing_context=None if context == "default" else context,
    )
    for _ in loader:
        print("READY", os.getpid(), flush=True)
        time.sleep(600)


if __name__ == "__main__":
    main()
