"""Elastic training under torchft on CPU: 3 replica groups train a tiny LM, one is killed
(SIGKILL) mid-run, a new one joins and heals, and the epoch ends with every document's tokens
delivered exactly once over the committed steps (checked from the rows' provenance).

    python examples/elastic_torchft.py          # ~20-50 s; needs pip install "torchdata-ext[torchft]"
    python examples/elastic_torchft.py --documents 150   # a smaller epoch (the tests' run)

The script starts a torchft Lighthouse and runs itself as each replica group
(``--replica``): a Manager on gloo, an :class:`~torchdata_ext.torchft.ElasticLoader`, a tiny
LM whose gradients are averaged through ``manager.allreduce``, ``should_commit()`` before each
optimizer step. Each group writes every step's rows (before its gradient leaves) and whether
the step committed; the audit at the end counts each token of each document over the steps
that committed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VOCAB = 512


def config(data: str):
    from torchdata_ext.pipeline.config import PipelineConfig

    return PipelineConfig(
        data_path=data, datasets="web,code", weights="2,1", seq_length=64, eos_token=0,
        bos_token=1, logical_shards=48, batch_size=4, seed=1, shuffle_buffer=16, block_docs=4,
        epochs=1, output_keys="input_ids,labels,provenance",
    )  # fmt: skip


def write_corpus(root: str, documents: int = 300) -> dict[tuple[str, int, int], int]:
    """Two small datasets of counting documents (each token the one before + 1, from a random
    start: a pattern the tiny LM learns), ``documents`` in ``web`` and half as many in
    ``code``; their lengths by (dataset, file, doc)."""
    from torchdata_ext.testing import write_arrow_batches

    rng = np.random.default_rng(0)
    lengths = {}
    for name, n in (("web", documents), ("code", documents // 2)):
        docs = [
            (
                (rng.integers(0, VOCAB) + np.arange(1 + int(rng.exponential(60)))) % (VOCAB - 2) + 2
            ).astype(np.uint32)
            for _ in range(n)
        ]
        for f in range(2):
            write_arrow_batches(f"{root}/{name}/p{f}.arrow", docs[f::2])
            lengths.update({(name, f, d): len(x) for d, x in enumerate(docs[f::2])})
    return lengths


def replica(lighthouse: str, data: str, out: str, rid: str) -> None:
    import torch
    from torch import nn

    from torchdata_ext import TokenLoader
    from torchdata_ext.pipeline.build import build_pipeline
    from torchdata_ext.torchft import ElasticLoader
    from torchdata_ext.torchft.local import local_manager

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def load(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    Path(out + ".ready").touch()
    while not os.path.exists(out + ".go"):
        time.sleep(0.01)
    manager = local_manager(
        lighthouse,
        rid,
        load,
        lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
    )
    build = functools.partial(build_pipeline, config(data))
    loader = ElasticLoader(manager, lambda r, n: TokenLoader(build, rank=r, world_size=n))
    with open(out, "a") as f:
        while True:
            manager.start_quorum()
            try:
                batch = next(loader)
            except StopIteration:
                break
            step, taking = manager.current_step(), manager.is_participating()
            rows = [] if batch is None or not taking else batch["provenance"].tolist()
            f.write(json.dumps({"step": step, "rows": rows, "n": manager.num_participants()}))
            f.write("\n")
            f.flush()
            opt.zero_grad()
            loss = torch.zeros(())
            if batch is not None:
                logits = model(batch["input_ids"])
                loss = nn.functional.cross_entropy(
                    logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
                )
                loss.backward()
            grads = [
                p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
            ]
            flat = torch.cat([g.flatten() for g in grads])
            manager.allreduce(flat).wait()  # the average over the participants
            at = 0
            for p, g in zip(model.parameters(), grads):
                p.grad = flat[at : at + g.numel()].view_as(g).clone()
                at += g.numel()
            time.sleep(0.03)
            committed = manager.should_commit()
            if committed:
                opt.step()
            seen = None if batch is None else float(loss)
            f.write(json.dumps({"step": step, "committed": committed, "loss": seen}))
            f.write("\n")
            f.flush()
    loader.close()
    manager.shutdown(wait=False)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--replica":
        replica(*sys.argv[2:6])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--documents", type=int, default=300,
        help="documents of the larger dataset (the other has half as many); at least 100, "
        "so the epoch outlasts the kill at step 8 and the join at step 16",
    )  # fmt: skip
    args = parser.parse_args()
    if args.documents < 100:
        parser.error(f"--documents {args.documents}: use at least 100 (the epoch must outlast "
                     "the kill at step 8 and the join at step 16)")  # fmt: skip
    from torchdata_ext.provenance import LITERAL, PAD
    from torchdata_ext.torchft import require_torchft

    # the Lighthouse's log of every quorum: quiet (read when torchft is first imported)
    os.environ.setdefault("RUST_LOG", "error")
    require_torchft()
    from torchdata_ext.torchft.local import (
        committed_attempts,
        read_step_log,
        start_lighthouse,
        stop_job,
    )

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        lengths = write_corpus(data, args.documents)
        # a quorum needs 2 groups: no group trains a step alone (two quorums at once would
        # each deliver that step's data: torchft's split brain, docs/elastic.md)
        lighthouse = start_lighthouse(min_replicas=2)
        outs = {rid: Path(tmp) / f"{rid}.jsonl" for rid in "abcd"}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        procs = {
            rid: subprocess.Popen(
                [sys.executable, __file__, "--replica", lighthouse.address(), data, str(o), rid],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=open(f"{o}.err", "w"),  # noqa: SIM115 - closed with the process
            )  # fmt: skip
            for rid, o in outs.items()
        }
        try:
            while not all(Path(f"{o}.ready").exists() for o in outs.values()):
                time.sleep(0.05)
            print("3 replica groups (a, b, c) start; d waits")
            for rid in "abc":
                Path(f"{outs[rid]}.go").touch()
            # c is killed after step 8 and after it trained in a quorum of all 3 (on a busy
            # machine c can start late: killed before that, its death tests nothing)
            while len(read_step_log(outs["a"])) < 2 * 8 or not any(
                r.get("n") == 3 for r in read_step_log(outs["c"])
            ):
                time.sleep(0.02)
            procs["c"].send_signal(signal.SIGKILL)
            print("step ~8: c killed (SIGKILL)")
            while len(read_step_log(outs["a"])) < 2 * 16:
                time.sleep(0.02)
            Path(f"{outs['d']}.go").touch()
            print("step ~16: d starts, heals from a live group and joins")
            deadline = time.monotonic() + 300
            while True:  # a group that fails leaves the others waiting for its quorum
                codes = {rid: procs[rid].poll() for rid in "abd"}
                failed = [rid for rid, code in codes.items() if code not in (None, 0)]
                if not failed and None not in codes.values():
                    break
                if failed or time.monotonic() > deadline:
                    rid = failed[0] if failed else "a"
                    err = Path(f"{outs[rid]}.err").read_text().strip().splitlines()
                    print(f"replica group {rid} failed or hangs:", *err[-15:], sep="\n")
                    sys.exit(1)
                time.sleep(0.05)
        finally:
            stop_job(procs, lighthouse)
        records = {rid: read_step_log(o) for rid, o in outs.items()}
    committed = committed_attempts(records.values())  # (step, participants) attempts
    count = {k: np.zeros(n, np.int32) for k, n in lengths.items()}
    names = ["web", "code"]
    for rs in records.values():
        last = {(r["step"], r["n"]): r for r in rs if "rows" in r}
        for key, r in last.items():
            if key in committed:
                for row in r["rows"]:
                    for ds, f, d, start, n in row:
                        if ds not in (LITERAL, PAD):
                            count[(names[ds], f, d)][start : start + n] += 1
    sizes = {rid: sorted({r["n"] for r in rs if "n" in r}) for rid, rs in records.items()}
    losses = [r["loss"] for r in records["a"] if r.get("committed") and r["loss"] is not None]
    print(
        f"steps committed: {len({s for s, _ in committed})}; participants seen by each group: {sizes}"
    )
    print(f"loss of group a: {losses[0]:.2f} at the first step, {losses[-1]:.2f} at the last")
    once = all((c == 1).all() for c in count.values())
    print(
        f"audit: {len(lengths)} documents, {sum(lengths.values())} tokens; "
        f"each delivered exactly once over the committed steps: {once}"
    )
    if not once:
        sys.exit(1)


if __name__ == "__main__":
    main()
