"""One torchft replica group for ``test_torchft_real.py`` (run as a script): a Manager on
gloo, an :class:`~torchdata_ext.torchft.ElasticLoader`, and a training step's shape (quorum,
batch, an all-reduce, ``should_commit``), recording each step's rows (before its gradient
all-reduce) and then whether it committed, as JSON lines.

The replica writes ``OUT.ready`` once imported and starts when ``OUT.go`` exists.
Usage: ``python _torchft_replica.py LIGHTHOUSE DATA_DIR OUT REPLICA_ID [--error-at STEP]
[--sync] [--sleep S] [--every K]``; ``--every``: the loader's ``exchange_every``;
``--error-at``: report an error in that step (it does not commit
here, as a local failure does under torchft).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import numpy as np
import torch

from torchdata_ext import TokenLoader
from torchdata_ext.pipeline.build import build_pipeline
from torchdata_ext.pipeline.config import PipelineConfig
from torchdata_ext.torchft import ElasticLoader
from torchdata_ext.torchft.local import local_manager


def config(data: str) -> PipelineConfig:
    """The real test's pipeline (the same as the simulated tests')."""
    return PipelineConfig(
        data_path=data, datasets="web,code", weights="2,1", seq_length=32, eos_token=0,
        bos_token=1, logical_shards=24, batch_size=2, seed=5, shuffle_buffer=6, block_docs=5,
        epochs=1, mix_quantum_tokens=0,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("lighthouse")
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("replica_id")
    p.add_argument("--error-at", type=int, default=-1)
    p.add_argument("--sync", action="store_true")
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--every", type=int, default=50)
    a = p.parse_args()
    # started ahead (imports take seconds here): say so, and start when told
    open(a.out + ".ready", "w").close()
    while not os.path.exists(a.out + ".go"):
        time.sleep(0.01)
    model = {"w": torch.zeros(4)}
    manager = local_manager(
        a.lighthouse,
        a.replica_id,
        lambda sd: model.update(sd),
        lambda: dict(model),
        use_async_quorum=not a.sync,
    )
    build = functools.partial(build_pipeline, config(a.data), collate=False)
    loader = ElasticLoader(
        manager, lambda r, n: TokenLoader(build, rank=r, world_size=n), exchange_every=a.every
    )
    with open(a.out, "a") as out:
        while True:
            manager.start_quorum()
            try:
                row = next(loader)
            except StopIteration:
                break
            step = manager.current_step()
            taking = manager.is_participating()
            # the attempt, written before the gradient leaves: if the others commit this step
            # with this group's gradient, its rows are on disk even if it is killed now
            rows = [] if row is None or not taking else [np.asarray(row["provenance"]).tolist()]
            attempt = {"step": step, "taking": taking, "rows": rows,
                       "positions": [] if not rows else [np.asarray(row["position_ids"]).tolist()],
                       "participants": manager.num_participants()}  # fmt: skip
            out.write(json.dumps(attempt) + "\n")
            out.flush()
            grad = torch.ones(4)
            manager.allreduce(grad).wait()
            if step == a.error_at:
                manager.report_error(RuntimeError("a local failure (test)"))
            time.sleep(a.sleep)
            committed = manager.should_commit()
            if committed:
                model["w"] += grad
            out.write(json.dumps({"step": step, "committed": committed}) + "\n")
            out.flush()
    loader.close()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
