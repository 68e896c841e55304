"""Side by side with the loader this product replaces: IBM's fms-fsdp dataloader.

The same corpus (3 datasets 3:1:1 of Bamba-layout uint32 Arrow, lognormal documents), the same
config (seq 4096 + 1, batch 8, a 10,000-row shuffle buffer, 64 logical shards, int32 tokens),
through each loader as a training loop takes it, alternately, ``--repeat`` rounds:

* **fms-fsdp**: ``fms_fsdp.utils.dataloader_utils.get_data_loader`` with 0 and 2 workers (its
  state is saved by the workers every ``checkpoint_interval`` steps; here never, as in the
  issue's measurement);
* **torchdata-ext**: ``TokenLoader(functools.partial(build_pipeline, cfg), num_workers=w)``
  with ``state_dict()`` after every batch, for each ``--workers`` count.

Each round also measures the **raw limit** the issue states its targets against: every file
memory-mapped, its token column taken zero-copy and concatenated to int32 batches of 8 x 4,097
(pyarrow's C++ concatenation, one copy and the cast), no mixing, shuffling or packing. Each
loader's rate is printed as a share of it.

For each: seconds from building the loader to its first batch; input tokens per second over
``--batches`` batches after the first (after ``--after`` more, untimed: 1250 times the steady
state, the shuffle buffers full); CPU seconds per million tokens of the whole process tree
(the training process and its workers); the share of torchdata-ext's input tokens that are
padding (``document_ids`` -1; fms-fsdp never pads). And the first batch after a restore:
torchdata-ext's ``load_state_dict`` of a state taken after ``--restore-at`` batches (pickled, as a checkpoint
holds it); fms-fsdp's resume from the checkpoint its workers wrote at that step.

Each measurement runs in a process of its own (this script with ``--child``), so each gets a
clean **peak RSS**: the largest sum of the resident memory of its process tree (the training
process and its workers), sampled every 20 ms. ``--ref PATH`` adds the loader of another
checkout of this project (e.g. ``git worktree add /tmp/ref 04b86f6``), measured the same way
in the same rounds, so a change is compared with the commit before it on the same machine.

fms-fsdp is not on PyPI: clone it and pass the folder (the benchmark imports its loader from
there; nothing of it is copied into this project). Its ``file_type="arrow"`` passes the handler
class where an instance is expected and fails (at its commit 5a296af); ``"auto"`` reads Arrow
files with the same ``ArrowHandler``, so that is what runs. Its module imports
``transformers`` for the Parquet handler's tokenizer, which Arrow data does not use: a
placeholder stands in for it.

    git clone https://github.com/foundation-model-stack/fms-fsdp /tmp/fms-fsdp
    python benchmarks/old_loader.py --fms-fsdp /tmp/fms-fsdp [--tokens 150_000_000]
        [--batches 1000] [--after 0] [--repeat 3] [--workers 0 1 2 3] [--old-workers 0 2]
        [--ref PATH ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _corpus import BAMBA_SHARES, bamba_corpus  # noqa: E402
from _cpu import tree_cpu, tree_rss  # noqa: E402

from torchdata_ext import PipelineConfig, TokenLoader, build_pipeline  # noqa: E402

SEQ, BATCH, BUFFER, SHARDS = 4096, 8, 10_000, 64


class Run:
    """One measurement: first batch (s), tokens/s after it, CPU s per M tokens; and, once
    measured in its own process, the first batch after a restore (s) and the peak RSS of the
    process tree (bytes)."""

    def __init__(self, first: float, rate: float, cpu: float, restore: float = 0.0,
                 rss: int = 0, pad: float = 0.0) -> None:  # fmt: skip
        self.first, self.rate, self.cpu, self.restore, self.rss = first, rate, cpu, restore, rss
        self.pad = pad  # the share of the timed batches' input tokens that are padding


class PeakRss:
    """The largest :func:`tree_rss` seen while the ``with`` block runs (sampled every 20 ms)."""

    def __enter__(self) -> PeakRss:
        self.peak, self._stop = tree_rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, tree_rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss())


def timed(make: Callable[[], Iterator[Any]], tokens_of: Callable[[Any], int], batches: int,
          after: Callable[[], None] = lambda: None, skip: int = 0) -> Run:  # fmt: skip
    """Build an iterator, time its first batch, take ``skip`` more untimed, then time
    ``batches`` more; ``after()`` after each batch."""
    t0 = time.perf_counter()
    it = make()
    next(it)
    after()
    first = time.perf_counter() - t0
    for _ in range(skip):
        next(it)
        after()
    t1, c1 = time.perf_counter(), tree_cpu()
    tokens = 0
    for _ in range(batches):
        tokens += tokens_of(next(it))
        after()
    wall, cpu = time.perf_counter() - t1, tree_cpu() - c1
    return Run(first, tokens / wall, cpu / tokens * 1e6)


def load_fms(path: str) -> Callable[..., Any]:
    """fms-fsdp's ``get_data_loader``, imported from the clone at ``path``."""
    if not os.path.isdir(os.path.join(path, "fms_fsdp")):
        sys.exit(
            f"--fms-fsdp {path!r} is not a checkout of fms-fsdp (no fms_fsdp/ in it): clone "
            "https://github.com/foundation-model-stack/fms-fsdp and pass its folder"
        )
    # only its Parquet handler's tokenizer uses transformers (made, never called, by "auto")
    tokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: None)
    sys.modules["transformers"] = types.SimpleNamespace(AutoTokenizer=tokenizer)  # type: ignore[assignment]
    sys.path.insert(0, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fms_fsdp.utils.dataloader_utils import get_data_loader
    return get_data_loader


def fms_config(root: str, workers: int, ckpt: str, interval: int, resume: bool) -> Any:
    """fms-fsdp's training config for this benchmark's corpus and shape (its fields as
    ``fms_fsdp.config.training.train_config`` names them); saves every ``interval`` batches."""
    return types.SimpleNamespace(
        data_path=root, file_type="auto", col_name="tokens", tokenizer_path="",
        datasets=",".join(BAMBA_SHARES), weights="3,1,1", seq_length=SEQ, bos_token=None,
        eos_token=0, bol_token=None, eol_token=None, strip_tokens="", logical_shards=SHARDS,
        num_workers=workers, batch_size=BATCH, seed=2023, ckpt_load_path=ckpt,
        ckpt_save_path=ckpt, resuming_dataset=resume, checkpoint_interval=interval,
    )  # fmt: skip


def old_runs(get_loader: Callable[..., Any], root: str, workers: int, batches: int,
             restore_at: int, skip: int = 0) -> tuple[Run, float]:  # fmt: skip
    """fms-fsdp: a fresh run that saves nothing (timed), a second run whose workers save after
    ``restore_at`` batches of their own, and the first batch of a run resumed from that save."""
    ckpt = tempfile.mkdtemp(prefix="fms_ckpt_")
    quiet = _quiet_stdout()
    try:
        cfg = fms_config(root, workers, ckpt, 10**9, resume=False)  # the timed run saves nothing
        with quiet:
            run = timed(lambda: iter(get_loader(cfg, 0, 1)), lambda b: b[0].numel(), batches,
                        skip=skip)  # fmt: skip
        # its workers save after restore_at batches of their own (CheckpointDataset counts them)
        cfg = fms_config(root, workers, ckpt, restore_at, resume=False)
        with quiet:
            it = iter(get_loader(cfg, 0, 1))
            for _ in range(restore_at * max(1, workers) + 1):
                next(it)
            del it
        cfg = fms_config(root, workers, ckpt, 10**9, resume=True)
        t0 = time.perf_counter()
        with quiet:
            next(iter(get_loader(cfg, 0, 1)))
        return run, time.perf_counter() - t0
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


def new_runs(
    cfg: PipelineConfig, workers: int, batches: int, restore_at: int, skip: int = 0
) -> tuple[Run, float]:
    """torchdata-ext: a fresh run with a state after every batch, and the first batch after
    ``load_state_dict`` of the (pickled) state taken after ``restore_at`` batches."""
    holder: dict[str, Any] = {}

    def make() -> Iterator[Any]:
        holder["loader"] = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=workers)
        return iter(holder["loader"])

    run = timed(make, lambda b: b["input_ids"].numel(), batches,
                lambda: holder["loader"].state_dict(), skip)  # fmt: skip
    holder["loader"].close()
    # the padding of the same batches (the first and the timed ones, not the ``skip`` between),
    # untimed (document_ids is one more tensor to stack)
    counted = dataclasses.replace(cfg, output_keys=[*cfg.output_keys, "document_ids"])
    loader = TokenLoader(functools.partial(build_pipeline, counted), num_workers=workers)
    padding = sum(
        int((b["document_ids"] == -1).sum())
        for i, (b, _) in enumerate(zip(loader, range(skip + batches + 1)))
        if i == 0 or i > skip
    )
    run.pad = padding / ((batches + 1) * BATCH * SEQ)
    loader.close()
    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=workers)
    it = iter(loader)
    for _ in range(restore_at):
        next(it)
    saved = pickle.dumps(loader.state_dict())
    loader.close()
    t0 = time.perf_counter()
    again = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=workers)
    again.load_state_dict(pickle.loads(saved))
    next(iter(again))
    first = time.perf_counter() - t0
    again.close()
    return run, first


class _quiet_stdout:
    """fms-fsdp prints from every worker at each save and load."""

    def __enter__(self) -> None:
        self._saved = sys.stdout
        sys.stdout = open(os.devnull, "w")

    def __exit__(self, *exc: Any) -> None:
        sys.stdout.close()
        sys.stdout = self._saved


def raw_limit(root: str) -> float:
    """Tokens per second of the raw read: each Arrow file memory-mapped, its token column
    taken zero-copy, concatenated and cast to int32 batches of ``BATCH x (SEQ + 1)``."""
    import numpy as np
    import pyarrow as pa

    files = sorted(
        os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".arrow")
    )
    row = BATCH * (SEQ + 1)
    t0 = time.perf_counter()
    total = 0
    for path in files:
        with pa.memory_map(path) as source:
            column = pa.ipc.open_file(source).read_all().column(0)
            flat = column.combine_chunks().to_numpy(zero_copy_only=False).astype(np.int32)
            batches = flat[: len(flat) // row * row].reshape(-1, BATCH, SEQ + 1)
            total += batches.size
    return total / (time.perf_counter() - t0)


def child(args: argparse.Namespace) -> None:
    """``--child KIND WORKERS``: one measurement in this process, printed as a JSON line."""
    kind, workers = args.child[0], int(args.child[1])
    root = bamba_corpus(args.data_dir, args.tokens)
    with PeakRss() as peak:
        if kind == "fms":
            run, restore = old_runs(load_fms(args.fms_fsdp), root, workers, args.batches,
                                    args.restore_at, args.after)  # fmt: skip
        else:
            run, restore = new_runs(config(root), workers, args.batches, args.restore_at,
                                    args.after)  # fmt: skip
    print(json.dumps({"first": run.first, "rate": run.rate, "cpu": run.cpu, "restore": restore,
                      "rss": peak.peak, "pad": run.pad}))  # fmt: skip


def config(root: str) -> PipelineConfig:
    return PipelineConfig(
        data_path=root, datasets=list(BAMBA_SHARES), weights=[3, 1, 1], seq_length=SEQ,
        batch_size=BATCH, shuffle_buffer=BUFFER, logical_shards=SHARDS, eos_token=0,
        dtype="int32",
    )  # fmt: skip


def measured(args: argparse.Namespace, kind: str, workers: int, checkout: str | None) -> Run:
    """One measurement in a child process (``checkout``: the torchdata-ext to import)."""
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join([checkout, env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, str(workers),
           "--fms-fsdp", args.fms_fsdp, "--tokens", str(args.tokens), "--data-dir",
           os.path.abspath(args.data_dir), "--batches", str(args.batches), "--restore-at",
           str(args.restore_at), "--after", str(args.after)]  # fmt: skip
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True,
                         cwd=checkout or os.getcwd())  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return Run(got["first"], got["rate"], got["cpu"], got["restore"], got["rss"], got["pad"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fms-fsdp", required=True, help="a clone of foundation-model-stack/fms-fsdp")
    p.add_argument("--tokens", type=int, default=150_000_000, help="corpus size (tokens)")
    p.add_argument("--data-dir", default="bench_data/pipeline")
    p.add_argument("--batches", type=int, default=1000, help="batches timed after the first")
    p.add_argument("--restore-at", type=int, default=100, help="batches before the state taken")
    p.add_argument(
        "--after",
        type=int,
        default=0,
        help="batches taken untimed after the first, before the timed ones (1250: the "
        "10,000-row shuffle buffers are full, the steady state of a long run)",
    )
    p.add_argument("--repeat", type=int, default=3, help="alternating rounds; best and median")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--old-workers", type=int, nargs="+", default=[0, 2])
    p.add_argument(
        "--ref",
        action="append",
        default=[],
        help="another checkout of torchdata-ext, measured alongside in the same rounds "
        "(repeat the option for more)",
    )
    p.add_argument("--child", nargs=2, metavar=("KIND", "WORKERS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return

    load_fms(args.fms_fsdp)  # a bad --fms-fsdp fails here, not in a child
    root = bamba_corpus(args.data_dir, args.tokens)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results: dict[str, list[Run]] = {}
    raws: list[float] = []
    for _ in range(max(1, args.repeat)):
        raws.append(raw_limit(root))
        for w in args.old_workers:
            results.setdefault(f"fms-fsdp, {w} workers", []).append(measured(args, "fms", w, None))
        for w in args.workers:
            results.setdefault(f"torchdata-ext, {w} workers", []).append(
                measured(args, "new", w, here)
            )
            for ref in args.ref:
                label = f"{os.path.basename(os.path.normpath(ref))}, {w} workers"
                results.setdefault(label, []).append(measured(args, "new", w, ref))
    refs = {w: max(r.rate for r in results[f"fms-fsdp, {w} workers"]) for w in args.old_workers}
    timed_from = (
        f" and {args.after} untimed (the steady state)"
        if args.after
        else " (the buffers' fill included)"
    )
    print(
        f"corpus {args.tokens / 1e6:.0f}M tokens, seq {SEQ}+1 x batch {BATCH}, buffer {BUFFER}, "
        f"{SHARDS} logical shards; {args.batches} batches after the first{timed_from}, best of "
        f"{args.repeat} (median); torchdata-ext takes state_dict() after "
        "every batch"
    )
    raw = max(raws)
    print(
        f"raw limit (mmap, zero-copy, concatenated to int32 batches): {raw / 1e6:.0f}M tokens/s "
        f"(median {statistics.median(raws) / 1e6:.0f}M)"
    )
    for label, runs in results.items():
        rates = [r.rate for r in runs]
        firsts = [r.first for r in runs]
        restores = [r.restore for r in runs]
        ratios = ", ".join(f"{max(rates) / ref:.2f}x fms-fsdp {w}w" for w, ref in refs.items())
        print(
            f"{label:26s} {max(rates) / 1e6:6.2f}M tokens/s (median "
            f"{statistics.median(rates) / 1e6:.2f}M; {ratios}; {max(rates) / raw:.1%} of the raw "
            f"limit); peak RSS {min(r.rss for r in runs) / 1e9:.2f}-"
            f"{max(r.rss for r in runs) / 1e9:.2f} GB; CPU "
            f"{min(r.cpu for r in runs):.3f} s/M tokens; first batch {min(firsts):.3f} s "
            f"(median {statistics.median(firsts):.3f}); after a restore {min(restores):.3f} s "
            f"(median {statistics.median(restores):.3f}); padding {max(r.pad for r in runs):.3%} "
            "of the tokens"
        )


if __name__ == "__main__":
    main()
