"""The audit at 30,720 logical shards x 3 datasets: how long ``audit_checkpoint`` takes.

Writes 3 CEPED datasets (3 files x 12,000 documents of 1-3 tokens each, so 30,720 shards hold
one or two documents), runs the full pipeline (interleave, pack, shuffle buffer) in this
process as ``--ranks`` ranks of one worker each, a few steps per rank, saves one folder
checkpoint, then times (CPU time of this process, best of ``--repeat``):

* ``audit_checkpoint`` with replay (the default: each worker's pack and what feeds it is
  restored to find the pieces it holds) and without (``replay=False``: the checkpoint and the
  counts only), and the replay's cost per worker;
* ``AuditReport.documents()`` (the vectorised walk over every shard's cursor).

    python benchmarks/audit_scale.py [--shards 30720] [--ranks 4] [--steps 10] [--repeat 3]
"""

from __future__ import annotations

import argparse
import functools
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from torchdata_ext import PipelineConfig, TokenLoader, build_pipeline
from torchdata_ext.audit.report import audit_checkpoint
from torchdata_ext.checkpoint.folder import save_checkpoint
from torchdata_ext.testing import write_ceped_npy


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=30_720)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="audit_scale_"))
    try:
        _run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(args: argparse.Namespace, root: Path) -> None:
    rng = np.random.default_rng(0)
    per_file = -(-args.shards // 3) + 1_760
    for name in ("a", "b", "c"):
        for f in range(3):
            docs = [rng.integers(2, 1000, rng.integers(1, 4)) for _ in range(per_file)]
            write_ceped_npy(str(root / "data" / name / f"p{f}.npy"), docs, dtype=np.int32)
    cfg = PipelineConfig(
        data_path=str(root / "data"), datasets="a,b,c", file_type="ceped", seq_length=64,
        eos_token=0, logical_shards=args.shards, batch_size=4, shuffle_buffer=8, seed=1,
    )  # fmt: skip
    ckpt = str(root / "ckpt")
    for rank in range(args.ranks):
        loader = TokenLoader(
            functools.partial(build_pipeline, cfg), rank=rank, world_size=args.ranks
        )
        for step, _ in enumerate(loader, 1):
            if step == args.steps:
                break
        save_checkpoint(loader, ckpt)
    t_replay, report = _best(lambda: audit_checkpoint(ckpt, cfg), args.repeat)
    t_quick, _ = _best(lambda: audit_checkpoint(ckpt, cfg, replay=False), args.repeat)
    t_docs, table = _best(lambda: report.documents(), args.repeat)  # type: ignore[attr-defined]
    workers = args.ranks
    print(report.format_table())  # type: ignore[attr-defined]
    print(
        f"{args.shards:,} shards x 3 datasets, {workers} workers: audit {t_replay:.2f} s "
        f"(replay {(t_replay - t_quick) / workers * 1000:.0f} ms per worker), without replay "
        f"{t_quick:.2f} s, documents() {t_docs:.2f} s for {table.num_rows:,} rows "  # type: ignore[attr-defined]
        f"(CPU time, best of {args.repeat})"
    )


if __name__ == "__main__":
    main()
