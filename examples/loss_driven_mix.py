"""Loss-driven data mixing: reweight three datasets online from their losses, through a resume.

Run with no arguments (CPU, about a minute on 2 cores)::

    python examples/loss_driven_mix.py
    python examples/loss_driven_mix.py --plot mix.png     # also draw the weights and shares

What it does, and checks:

1. **Data.** Three datasets of unequal difficulty, tokenized with the byte tokenizer by
   ``torchdata-ext prepare``: ``code`` and ``prose`` (the standard library's ``*.py`` files and
   their docstrings, as in ``train_tiny_lm.py``) and ``tables`` (multiplication tables: easy,
   the model learns them quickly).
2. **Train** the tiny LM of ``train_tiny_lm.py`` under :class:`TokenLoader` with 2 workers; every
   ``--every`` steps compute the mean loss per dataset from the batch's ``dataset_ids`` key
   (which dataset each label token came from) and update the weights by exponentiated gradient
   (``w_d <- w_d * exp(eta * loss_d / mean loss)``, normalized, mixed with 10% uniform), handing
   them to the loader with :meth:`TokenLoader.set_weights` from the earliest step it can honour.
3. **Resume at 3 workers** from a folder checkpoint saved mid-run: the weight changes made so far
   are in the loader state, so the restored loader goes on with the same mix, and the
   reweighting goes on.
   After the resume the delivered shares go on following the targets: the rest of each long
   ``code`` document open at the checkpoint is handed back to its reader and the new worker's
   mix cuts it at row ends like any document, which the table shows.
4. **Show and check**: the weights over time and the achieved token share of each dataset in
   each segment between changes (from ``dataset_ids``, counted per delivered token), and that no
   document token was delivered twice across the resume (from the batches' provenance).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_tiny_lm import TinyLM, make_corpus, repeated_tokens, train_step  # noqa: E402

from torchdata_ext import PipelineConfig, TokenLoader, build_pipeline  # noqa: E402
from torchdata_ext.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from torchdata_ext.cli import prepare  # noqa: E402
from torchdata_ext.provenance import LITERAL, PAD  # noqa: E402
from torchdata_ext.testing import write_jsonl  # noqa: E402

DATASETS = ("code", "prose", "tables")


# -- 1. data -----------------------------------------------------------------------------------------
def make_tables(data_dir: str, docs: int = 400) -> None:
    """``tables/``: multiplication tables, one per document (easy to learn: the model's loss
    on them falls first, so the reweighting moves weight away from them)."""
    if os.path.exists(os.path.join(data_dir, "tables", "meta")):
        return
    rng = np.random.default_rng(0)
    texts = []
    for _ in range(docs):
        a = int(rng.integers(2, 40))
        texts.append("".join(f"{a} x {b} = {a * b}\n" for b in range(1, int(rng.integers(20, 60)))))
    raw = os.path.join(data_dir, "raw", "tables")
    for k in range(4):
        write_jsonl(os.path.join(raw, f"tables_{k}.jsonl"), texts[k::4])
    prepare(raw, os.path.join(data_dir, "tables"), format="arrow", tokenizer="byte",
            byte_offset=1, progress=False)  # fmt: skip


def make_config(data_dir: str, seed: int) -> PipelineConfig:
    return PipelineConfig(
        data_path=data_dir,
        datasets=list(DATASETS),
        weights=[1, 1, 1],  # the start; the trainer changes them
        file_type="arrow",
        col_name="tokens",
        seq_length=128,
        eos_token=0,
        logical_shards=64,
        batch_size=8,
        shuffle_buffer=4,  # a small buffer: a weight change reaches the batches soon
        output_keys=["input_ids", "labels", "loss_mask", "dataset_ids", "provenance"],
        seed=seed,
    )


# -- 2. the reweighting ------------------------------------------------------------------------------
class Mixer:
    """Exponentiated gradient on the per-dataset loss: every ``every`` steps,
    ``w_d <- w_d * exp(eta * loss_d / mean loss)``, normalized, then mixed with ``floor`` of the
    uniform mix so no dataset starves. The losses are token means since the last update."""

    def __init__(self, names: list[str], every: int, eta: float = 1.0, floor: float = 0.1):
        self.names = names
        self.every, self.eta, self.floor = every, eta, floor
        self.weights = np.full(len(names), 1.0 / len(names))
        self.sums = np.zeros(len(names))
        self.counts = np.zeros(len(names))

    def observe(self, loss_tok: torch.Tensor, ids: torch.Tensor) -> None:
        keep = ids >= 0
        k = ids[keep].long()
        self.sums += torch.zeros(len(self.names)).index_add_(0, k, loss_tok[keep]).numpy()
        self.counts += torch.bincount(k, minlength=len(self.names)).numpy()

    def update(self) -> dict[str, float]:
        seen = self.counts > 0
        loss = np.where(seen, self.sums / np.maximum(self.counts, 1), 0.0)
        mean = loss[seen].mean() if seen.any() else 1.0
        ratio = np.where(seen, loss / mean, 1.0)  # a dataset not seen keeps its footing
        w = self.weights * np.exp(self.eta * ratio)
        w = (1 - self.floor) * w / w.sum() + self.floor / len(w)
        self.weights = w
        self.sums[:], self.counts[:] = 0, 0
        return {n: round(float(x), 4) for n, x in zip(self.names, w)}

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights = np.asarray(state["weights"], dtype=np.float64)


class Shares:
    """Delivered tokens per dataset per segment of the weights (from ``dataset_ids``), and the
    document pieces delivered (from the provenance), for the exactly-once check."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.by_step: list[np.ndarray] = []  # tokens per dataset at each step
        self.pieces: list[tuple[int, int, int, int, int]] = []

    def __call__(self, batch: dict[str, torch.Tensor]) -> None:
        ids = batch["dataset_ids"].flatten()
        ids = ids[ids >= 0].long()
        self.by_step.append(torch.bincount(ids, minlength=len(self.names)).numpy())
        for ds, file, doc, start, length in batch["provenance"].reshape(-1, 5).tolist():
            if length and ds not in (LITERAL, PAD):
                self.pieces.append((ds, file, doc, start, length))

    def share(self, a: int, b: int) -> np.ndarray:
        """The token share of each dataset over steps ``a .. b`` (1-based, ``b`` included)."""
        got = np.sum(self.by_step[a - 1 : b], axis=0)
        return got / max(1, got.sum())


# -- 3. training -------------------------------------------------------------------------------------
def set_mix(loader: TokenLoader, weights: dict[str, float], step: int) -> int:
    """Hand ``weights`` to the loader from ``step`` or, if the loader has already made the batches
    of that step, from the earliest step it can still change; returns the step it takes effect."""
    at = max(step, loader.earliest_weight_step())
    loader.set_weights(weights, from_step=at)
    return at


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loader: TokenLoader,
    steps: range,
    mixer: Mixer,
    shares: Shares,
    changes: list[tuple[int, dict[str, float]]],
) -> list[float]:
    """Train over global ``steps``; every ``mixer.every`` steps a new mix from the losses."""
    losses = []
    it = iter(loader)
    for step in steps:
        batch = next(it)
        shares(batch)
        loss, loss_tok = train_step(model, opt, batch)
        losses.append(loss)
        mixer.observe(loss_tok, batch["dataset_ids"].reshape(-1))
        if step % mixer.every == 0:
            weights = mixer.update()
            changes.append((set_mix(loader, weights, step + 1), weights))
    return losses


# -- 4. what the mix did -----------------------------------------------------------------------------
def segments(
    changes: list[tuple[int, dict[str, float]]], last: int
) -> list[tuple[int, int, dict[str, float]]]:
    """``(first step, last step, weights)`` of each stretch of the run with one mix."""
    marks = [(1, {n: 1 / len(DATASETS) for n in DATASETS}), *changes]
    marks = [(s, w) for s, w in marks if s <= last]
    out = []
    for (a, w), nxt in zip(marks, [*marks[1:], (last + 1, {})]):
        if nxt[0] > a:
            out.append((a, nxt[0] - 1, w))
    return out


def report(segs: list[tuple[int, int, dict[str, float]]], shares: Shares) -> list[str]:
    lines = [f"{'steps':>9}  " + "  ".join(f"{n + ' target/got':>20}" for n in DATASETS)]
    for a, b, w in segs:
        total = sum(w.values())
        got = shares.share(a, b)
        cells = [f"{w[n] / total:>9.1%} / {got[k]:>7.1%}" for k, n in enumerate(DATASETS)]
        lines.append(f"{a:>4}-{b:<4}  " + "  ".join(f"{c:>20}" for c in cells))
    return lines


def plot(path: str, segs: list[tuple[int, int, dict[str, float]]], shares: Shares, resume: int):
    """The target weights over the steps (lines) and the share each dataset got in each
    stretch (dots), with the resume marked."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.5))
    ax = fig.subplots()
    for k, name in enumerate(DATASETS):
        xs, ys = [], []
        for a, b, w in segs:
            xs += [a, b + 1]
            ys += [w[name] / sum(w.values())] * 2
        line = ax.plot(xs, ys, label=f"{name} target")[0]
        mids = [(a + b) / 2 for a, b, _ in segs]
        ax.plot(mids, [shares.share(a, b)[k] for a, b, _ in segs], "o", color=line.get_color(),
                label=f"{name} delivered")  # fmt: skip
    ax.axvline(resume + 0.5, color="grey", linestyle="--", label="resume, 2 -> 3 workers")
    ax.set_xlabel("step")
    ax.set_ylabel("token share")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run(args: argparse.Namespace, data_dir: str) -> None:
    t0 = time.perf_counter()
    make_corpus(data_dir, args.max_files)  # code/ and prose/ (train_tiny_lm.py)
    make_tables(data_dir)
    cfg = make_config(data_dir, args.seed)
    build = functools.partial(build_pipeline, cfg)
    torch.manual_seed(args.seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mixer = Mixer(list(DATASETS), args.every)
    shares = Shares(list(DATASETS))
    changes: list[tuple[int, dict[str, float]]] = []

    # -- phase 1: 2 workers, then a checkpoint of the loader (its weight changes included)
    loader = TokenLoader(build, num_workers=2)
    assert loader.dataset_names == list(DATASETS), loader.dataset_names
    losses = train(model, opt, loader, range(1, args.steps + 1), mixer, shares, changes)
    ckpt = os.path.join(data_dir, "ckpt")
    save_checkpoint(loader, ckpt)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, os.path.join(ckpt, "m.pt"))
    with open(os.path.join(ckpt, "mixer.json"), "w") as f:
        json.dump({"mixer": mixer.state_dict(), "changes": changes}, f)
    loader.close()
    print(f"phase 1 (2 workers): steps 1-{args.steps}, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"{len(changes)} weight changes; checkpoint saved")  # fmt: skip

    # -- phase 2: a new job with 3 workers: the loader, model and mixer from the checkpoint
    loader = TokenLoader(build, num_workers=args.resume_workers)
    load_checkpoint(loader, ckpt)  # rescales 2 -> 3 workers; the weight changes come with it
    saved = torch.load(os.path.join(ckpt, "m.pt"))
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    with open(os.path.join(ckpt, "mixer.json")) as f:
        kept = json.load(f)
    mixer.load_state_dict(kept["mixer"])
    changes = [(int(s), w) for s, w in kept["changes"]]
    last = args.steps + args.resume_steps
    losses2 = train(model, opt, loader, range(args.steps + 1, last + 1), mixer, shares, changes)
    loader.close()
    print(f"phase 2 ({args.resume_workers} workers): steps {args.steps + 1}-{last}, loss {losses2[0]:.3f} -> "
          f"{losses2[-1]:.3f}")  # fmt: skip

    # -- what the mix did, and the checks
    segs = segments(changes, last)
    print("weights over time (token share: target / delivered, from dataset_ids):")
    print("\n".join(report(segs, shares)))
    final = segs[-1][2]
    repeated = repeated_tokens(shares.pieces)
    delivered = sum(p[4] for p in shares.pieces)
    print(
        f"verified: {delivered:,} document tokens delivered, {repeated} repeated "
        "(2 workers -> checkpoint -> 3 workers, with the weights changing)"
    )
    if repeated:
        raise SystemExit("FAILED: a document's tokens were delivered twice")
    if not final["tables"] < min(final["code"], final["prose"]):
        raise SystemExit(f"FAILED: the easy dataset did not lose weight: {final}")
    print(f"verified: the easiest dataset (tables) ends with the least weight: {final}")
    if args.plot:
        plot(args.plot, segs, shares, args.steps)
        print(f"plot written to {args.plot}")
    print(f"OK: loss-driven mixing over {last} steps, resumed at 3 workers, no document "
          f"repeated ({time.perf_counter() - t0:.1f}s)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="steps before the checkpoint")
    p.add_argument("--resume-steps", type=int, default=40, help="steps after the resume")
    p.add_argument("--resume-workers", type=int, default=3, help="workers after the resume")
    p.add_argument("--every", type=int, default=5, help="steps between weight updates")
    p.add_argument("--max-files", type=int, default=80, help="standard-library files to use")
    p.add_argument("--plot", default=None, help="write the weights and shares to this PNG")
    p.add_argument("--data-dir", default=None, help="where to prepare the data (default: a "
                   "temporary folder, deleted at exit)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.max_files < 64:
        p.error("--max-files must be >= 64 (one code document per file, 64 logical shards)")
    if args.data_dir is not None:
        run(args, args.data_dir)
        return 0
    tmp = tempfile.mkdtemp(prefix="loss_mix_")
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
