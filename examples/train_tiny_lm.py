"""Train a tiny causal LM on the Python standard library with torchdata-ext, end to end.

Run with no arguments (CPU, 25-65 s on 2 cores)::

    python examples/train_tiny_lm.py                # 1 process
    python examples/train_tiny_lm.py --nproc 2      # 2 ranks under torchrun (gloo)
    python examples/train_tiny_lm.py --steps 8      # fast mode

What it does, and checks:

1. **Data.** A small real corpus every machine has: the standard library's ``*.py`` files
   (``code``, one document per file) and their docstrings (``prose``, extracted with ``ast``),
   written as JSONL and tokenized in-process by ``torchdata-ext prepare``
   (:func:`torchdata_ext.cli.prepare`) with the byte tokenizer (``offset=1``: ids 1..256 are
   bytes, 0 is free for EOS) into two Arrow sub-datasets, Bamba layout.
2. **Pipeline.** :func:`build_pipeline` from a :class:`PipelineConfig` (weights code 1 : prose 2,
   ``seq_length=128``, ``shuffle_buffer=256``, ``logical_shards=64``, ``eos_token=0``), batches
   collated with their provenance (where every token came from), under :class:`TokenLoader`
   with 2 workers.
3. **Train** a 2-layer causal transformer (``d_model=64``) for ``--steps`` steps, then save the
   model, the optimizer and the loader with ``torch.distributed.checkpoint`` (the loader through
   :class:`DCPLoaderState`) and a loader folder checkpoint (:func:`save_checkpoint`).
4. **Resume with 3 workers**: the model and optimizer from DCP, the loader from the folder
   checkpoint through :func:`load_checkpoint` (which rescales 2 -> 3 workers mid-epoch), and
   train ``--resume-steps`` more steps.
5. **Verify**: every delivered sequence equals the tokens its provenance names, read back from
   the shard files; no token of any document was delivered twice (before or after the resume,
   on any rank); and the loss went down from the start and continued after the resume.
6. **Audit** the final loader checkpoint (:func:`torchdata_ext.audit.report.audit_checkpoint`): print
   what it says each dataset consumed, and check that its tokens consumed minus those in
   flight equal the document tokens delivered.
"""

from __future__ import annotations

import argparse
import ast
import functools
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from collections import defaultdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torchdata.nodes import BaseNode

from torchdata_ext import PipelineConfig, TokenLoader, World, build_pipeline
from torchdata_ext.audit.report import audit_checkpoint
from torchdata_ext.checkpoint import DCPLoaderState, load_checkpoint, save_checkpoint
from torchdata_ext.cli import prepare
from torchdata_ext.nodes.collate import DEFAULT_KEYS, Collate
from torchdata_ext.nodes.pack import Pack
from torchdata_ext.pipeline.build import build_datasets
from torchdata_ext.provenance import LITERAL, PAD
from torchdata_ext.state.graph import graph_nodes
from torchdata_ext.testing import write_jsonl

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

VOCAB = 257  # byte tokenizer with offset 1 (ids 1..256) plus EOS = 0
DATASETS = ("code", "prose")


# -- 1. data -----------------------------------------------------------------------------------------
def make_corpus(data_dir: str, max_files: int) -> None:
    """Standard-library code and docstrings -> JSONL -> ``prepare`` -> ``code/``, ``prose/``."""
    if os.path.exists(os.path.join(data_dir, "prepared.ok")):
        return
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:max_files]
    code: list[str] = []
    prose: list[str] = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            src = f.read()
        code.append(src)
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    prose.append(doc)
    raw = os.path.join(data_dir, "raw")
    for name, texts in (("code", code), ("prose", prose)):
        for k in range(4):  # a few input files per sub-dataset
            write_jsonl(os.path.join(raw, name, f"{name}_{k}.jsonl"), texts[k::4])
        prepare(
            os.path.join(raw, name),
            os.path.join(data_dir, name),
            format="arrow",
            tokenizer="byte",
            byte_offset=1,
            max_tokens_per_file=400_000,
            progress=False,
        )
    with open(os.path.join(data_dir, "prepared.ok"), "w") as f:
        f.write(json.dumps({"code_docs": len(code), "prose_docs": len(prose)}))


# -- 2. pipeline ---------------------------------------------------------------------------------------
def make_config(data_dir: str, seed: int) -> PipelineConfig:
    return PipelineConfig(
        data_path=data_dir,
        datasets=list(DATASETS),
        weights=[1, 2],  # in tokens: a third code, two thirds prose
        file_type="arrow",
        col_name="tokens",
        seq_length=128,
        eos_token=0,
        logical_shards=64,
        batch_size=8,
        shuffle_buffer=256,
        output_keys=["input_ids", "labels", "position_ids", "loss_mask"],
        seed=seed,
    )


class NamedProvenance(BaseNode):
    """Rewrites each batch's provenance dataset ids (which are per worker, in order of first
    appearance) to positions in the fixed list ``DATASETS``. Holds no data: its state is its
    source's, and ``inflight()`` is empty, so checkpoints still rescale."""

    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode, pack: Pack) -> None:
        super().__init__()
        self.source = source
        self.pack = pack

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state[self.SOURCE_KEY])

    def next(self) -> dict[str, torch.Tensor]:
        batch = next(self.source)
        prov = batch["provenance"]
        ids = prov[..., 0]
        lut = torch.tensor([DATASETS.index(n) for n in self.pack.dataset_names] or [0])
        real = ids >= 0
        ids[real] = lut[ids[real]]
        return batch

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict()}

    def inflight(self) -> list[Any]:
        return []


def build(cfg: PipelineConfig, world: World) -> BaseNode:
    """One worker's graph: the standard pipeline, collated with provenance."""
    node = build_pipeline(cfg, world, collate=False)
    pack = next(n for n in graph_nodes(node) if isinstance(n, Pack))
    node = Collate(node, cfg.batch_size, keys=(*DEFAULT_KEYS, "provenance"))
    return NamedProvenance(node, pack)


# -- 3. model --------------------------------------------------------------------------------------------
class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, d_model: int = 64, layers: int = 2, seq: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        x = self.embed(ids) + self.pos(torch.arange(t))
        return self.head(self.encoder(x, mask=mask, is_causal=True))


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
) -> tuple[float, torch.Tensor]:
    """One optimizer step on ``batch``: the loss over ``loss_mask``, and each label token's
    loss (detached, flat), e.g. for a loss per dataset."""
    logits = model(batch["input_ids"])
    loss_tok = nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), reduction="none"
    )
    mask = batch["loss_mask"].reshape(-1).float()
    loss = (loss_tok * mask).sum() / mask.sum().clamp(min=1)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item(), loss_tok.detach()


def train_steps(
    model: nn.Module, opt: torch.optim.Optimizer, loader: TokenLoader, steps: int, record: Recorder
) -> list[float]:
    losses = []
    it = iter(loader)
    for _ in range(steps):
        batch = next(it)
        record(batch)
        losses.append(train_step(model, opt, batch)[0])
    return losses


# -- 5. checks -------------------------------------------------------------------------------------------
class Recorder:
    """Checks each batch against the shard files and collects the delivered token pieces."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.indexes = build_datasets(cfg)
        self.handlers = {n: ix.handler() for n, ix in self.indexes.items()}
        self.readers: dict[tuple[str, int], Any] = {}
        self.pieces: list[tuple[int, int, int, int, int]] = []
        self.sequences = 0

    def _doc(self, ds: str, file: int, doc: int) -> np.ndarray:
        key = (ds, file)
        if key not in self.readers:
            self.readers[key] = self.handlers[ds].open(self.indexes[ds].files[file])
        return np.asarray(self.handlers[ds].get(self.readers[key], doc))

    def __call__(self, batch: dict[str, torch.Tensor]) -> None:
        full = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1).numpy()
        for row, prov in zip(full, batch["provenance"].numpy()):
            parts = []
            for ds, file, doc, start, length in prov.tolist():
                if length == 0:
                    continue
                if ds in (LITERAL, PAD):
                    parts.append(np.full(length, file))
                else:
                    parts.append(self._doc(DATASETS[ds], file, doc)[start : start + length])
                    self.pieces.append((ds, file, doc, start, length))
            if not np.array_equal(np.concatenate(parts), row):
                raise SystemExit("FAILED: a sequence differs from the tokens its provenance names")
            self.sequences += 1


def repeated_tokens(pieces: list[tuple[int, int, int, int, int]]) -> int:
    """Tokens delivered more than once (overlapping pieces of the same document)."""
    by_doc: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)
    for ds, file, doc, start, length in pieces:
        by_doc[(ds, file, doc)].append((start, start + length))
    overlap = 0
    for spans in by_doc.values():
        spans.sort()
        end = -1
        for a, b in spans:
            overlap += max(0, min(end, b) - a)
            end = max(end, b)
    return overlap


# -- main ------------------------------------------------------------------------------------------------
def relaunch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this script under ``torchrun --nproc-per-node N`` (data prepared once, here)."""
    tmp = None
    data_dir = args.data_dir
    if data_dir is None:
        tmp = tempfile.mkdtemp(prefix="tiny_lm_")
        data_dir = tmp
    make_corpus(data_dir, args.max_files)
    rest = [a for a in argv if not a.startswith("--nproc")]
    if "--nproc" in argv:  # drop the value of "--nproc N"
        i = argv.index("--nproc")
        rest = argv[:i] + argv[i + 2 :]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", os.path.abspath(__file__), *rest,
           "--data-dir", data_dir, *(["--data-dir-is-temporary"] if tmp else [])]  # fmt: skip
    try:
        return subprocess.call(cmd)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, data_dir: str) -> None:
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    say = print if rank == 0 else (lambda *a, **k: None)
    t0 = time.perf_counter()
    if rank == 0:
        make_corpus(data_dir, args.max_files)
    if distributed:
        dist.barrier()
    cfg = make_config(data_dir, args.seed)
    rec = Recorder(cfg)
    for name, ix in rec.indexes.items():
        say(
            f"{name}: {len(ix.files)} files, {ix.total_docs:,} documents, {ix.total_tokens:,} tokens"
        )
    say(f"data ready in {time.perf_counter() - t0:.1f}s; {world_size} rank(s)")

    torch.manual_seed(args.seed)
    model: nn.Module = TinyLM()
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    build_fn = functools.partial(build, cfg)

    # -- phase 1: 2 workers, then checkpoint
    loader = TokenLoader(build_fn, num_workers=2)
    losses1 = train_steps(model, opt, loader, args.steps, rec)
    ckpt = os.path.join(data_dir, "ckpt", f"step_{args.steps}")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "data": DCPLoaderState(loader)},
             checkpoint_id=os.path.join(ckpt, "dcp"))  # fmt: skip
    save_checkpoint(loader, os.path.join(ckpt, "loader"))
    state_bytes = sum(
        os.path.getsize(os.path.join(ckpt, "loader", f))
        for f in os.listdir(os.path.join(ckpt, "loader"))
    )
    del loader
    say(f"phase 1: {args.steps} steps, loss {losses1[0]:.3f} -> {losses1[-1]:.3f}; "
        f"checkpoint saved in {ckpt} (loader folder {state_bytes:,} bytes)")  # fmt: skip

    # -- phase 2: a "new job": fresh model, optimizer and loader with 3 workers
    torch.manual_seed(args.seed + 1)
    model2: nn.Module = TinyLM()
    if distributed:
        model2 = nn.parallel.DistributedDataParallel(model2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=3e-3)
    msd2, osd2 = get_state_dict(model2, opt2)
    state: dict[str, Any] = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=os.path.join(ckpt, "dcp"))
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loader2 = TokenLoader(build_fn, num_workers=args.resume_workers)
    load_checkpoint(loader2, os.path.join(ckpt, "loader"))  # rescales 2 -> 3 workers
    losses2 = train_steps(model2, opt2, loader2, args.resume_steps, rec)
    final = os.path.join(data_dir, "ckpt", f"step_{args.steps + args.resume_steps}", "loader")
    save_checkpoint(loader2, final)
    del loader2
    say(f"phase 2 ({args.resume_workers} workers): {args.resume_steps} steps, loss {losses2[0]:.3f} -> "
        f"{losses2[-1]:.3f}")  # fmt: skip

    # -- checks
    pieces = rec.pieces
    if distributed:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, pieces)
        pieces = [p for part in gathered for p in part]
    k = max(1, min(3, args.steps // 2, args.resume_steps))
    start, before, after = (float(np.mean(x)) for x in (losses1[:k], losses1[-k:], losses2[:k]))
    if rank == 0:
        repeated = repeated_tokens(pieces)
        delivered = sum(p[4] for p in pieces)
        # the loss went down and did not jump back up at the resume (it may go on falling fast)
        ok_loss = after < start and before < start and after < before + 0.5
        print(f"verified: {rec.sequences} sequences on rank 0 equal the tokens their provenance "
              "names in the shard files")  # fmt: skip
        print(f"verified: {delivered:,} document tokens delivered on {world_size} rank(s), "
              f"{repeated} repeated (2 workers -> checkpoint -> {args.resume_workers} workers)")  # fmt: skip
        print(f"verified: loss {start:.3f} at the start, {before:.3f} before the checkpoint, "
              f"{after:.3f} after the resume")  # fmt: skip
        if repeated:
            raise SystemExit("FAILED: a document's tokens were delivered twice in the epoch")
        # -- what the final checkpoint says was consumed, checked against what was delivered
        audit = audit_checkpoint(final, cfg)
        print(audit.format_table())
        checked = []  # datasets still in their first epoch: every token delivered is counted
        for ds in audit.datasets:
            if [e.epoch for e in ds.epochs] != [0] or ds.current.tokens is None:
                continue
            got = sum(p[4] for p in pieces if DATASETS[p[0]] == ds.name)
            if ds.current.tokens - (ds.in_flight_tokens or 0) != got:
                raise SystemExit(
                    f"FAILED: the audit of {ds.name} disagrees with what was delivered"
                )
            checked.append(f"{ds.name} {got:,}")
        print(f"verified: the audit's tokens consumed minus those in flight equal the document "
              f"tokens delivered ({', '.join(checked)})")  # fmt: skip
        if not ok_loss or not math.isfinite(after):
            raise SystemExit("FAILED: the loss did not decrease and continue after the resume")
        print(f"OK: trained {args.steps}+{args.resume_steps} steps, resumed from DCP + loader "
              f"checkpoint with {args.resume_workers} workers, no document repeated "
              f"({time.perf_counter() - t0:.1f}s)")  # fmt: skip
        where = os.path.join(data_dir, "ckpt")
        if args.data_dir is None or args.data_dir_is_temporary:
            print(f"checkpoints and corpus were in the temporary folder {data_dir}, deleted at "
                  "exit: pass --data-dir DIR to keep them")  # fmt: skip
        else:
            print(f"checkpoints kept in {where} (and the corpus in {data_dir})")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="training steps before the checkpoint")
    p.add_argument("--resume-steps", type=int, default=None, help="steps after (default steps/2)")
    p.add_argument("--data-dir", default=None,
                   help="where to prepare the corpus and keep the checkpoints (default: a "
                   "temporary folder, deleted at exit)")  # fmt: skip
    p.add_argument("--data-dir-is-temporary", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, default=1, help="ranks (runs itself under torchrun)")
    p.add_argument("--max-files", type=int, default=120, help="standard-library files to use")
    p.add_argument("--resume-workers", type=int, default=3, help="workers after the resume")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.resume_steps is None:
        args.resume_steps = max(4, args.steps // 2)
    if args.steps < 2:
        p.error("--steps must be >= 2")
    if args.max_files < 64:
        p.error("--max-files must be >= 64 (one code document per file, 64 logical shards)")
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return relaunch(args, argv)
    if args.data_dir is not None:
        run(args, args.data_dir)
        return 0
    with tempfile.TemporaryDirectory(prefix="tiny_lm_") as tmp:
        run(args, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
