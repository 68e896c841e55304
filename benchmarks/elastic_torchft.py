"""Cost of following a torchft quorum, and what torchft's own sampler repeats or skips.

A real torchft job on this machine: a Lighthouse, 3 replica groups (processes, Managers on
gloo, asynchronous quorum), each with an :class:`~torchdata_ext.torchft.ElasticLoader` over
two Arrow datasets (seq_len 512, batch 4, 240 logical shards, a 64-row shuffle buffer). Group
``c`` is killed (SIGKILL) at 1/6 of the epoch, a new group ``d`` joins at 1/3, and the job runs
to the end of the epoch. Each group times every step's ``next(loader)``, the part of it spent
in the states' exchange (``start_allgather``, in step 0 and every ``--every`` steps), the
bytes of its all-reduce, and as the reference in the same run a plain ``TokenLoader``'s
``next()`` on a fixed share of the same pipeline, right after the elastic one in every step.
The committed rows are checked: tokens repeated and tokens never delivered.

Then the same kill-and-join timeline with ``torchft.data.DistributedSampler`` (one sample a
document, the same documents, 3 replica groups configured, the new group taking the dead one's
``replica_rank`` and starting its sampler over, as it does without a data checkpoint):
samples and tokens it repeats or skips over the epoch.

    python benchmarks/elastic_torchft.py [--docs 4000] [--capacity none|BYTES] [--every 50]
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
from typing import Any

import numpy as np

from torchdata_ext.testing import write_arrow_batches
from torchdata_ext.torchft.local import read_step_log


def config(data: str):
    from torchdata_ext.pipeline.config import PipelineConfig

    return PipelineConfig(
        data_path=data, datasets="web,code", weights="2,1", seq_length=512, eos_token=0,
        bos_token=1, logical_shards=240, batch_size=4, seed=5, shuffle_buffer=64, block_docs=8,
        epochs=1, output_keys="input_ids,labels,position_ids,provenance",
    )  # fmt: skip


def write_corpus(root: str, docs: int) -> dict[tuple[str, int, int], int]:
    """Two datasets of lognormal documents (median 300 tokens), two files each; the lengths."""
    rng = np.random.default_rng(0)
    lengths = {}
    for name, n in (("web", 2 * docs // 3), ("code", docs - 2 * docs // 3)):
        ds = [
            rng.integers(5, 30_000, int(np.clip(rng.lognormal(np.log(300), 1.0), 16, 8000))).astype(
                np.uint32
            )
            for _ in range(n)
        ]
        for f in range(2):
            write_arrow_batches(f"{root}/{name}/p{f}.arrow", ds[f::2])
            for d, doc in enumerate(ds[f::2]):
                lengths[(name, f, d)] = len(doc)
    return lengths


# -- one replica group ---------------------------------------------------------------------------
def replica(
    lighthouse: str,
    data: str,
    out: str,
    rid: str,
    mode: str = "elastic",
    capacity: str = "none",
    every: str = "50",
) -> None:
    import torch

    import torchdata_ext.torchft.loader as elastic_loader
    from torchdata_ext import TokenLoader
    from torchdata_ext.pipeline.build import build_pipeline
    from torchdata_ext.torchft import ElasticLoader
    from torchdata_ext.torchft.local import local_manager

    build = functools.partial(build_pipeline, config(data))
    plain = TokenLoader(build, rank=0, world_size=3)
    it = iter(plain)
    next(it)
    t0 = time.perf_counter()
    for _ in range(40):
        next(it)
    plain_next = (time.perf_counter() - t0) / 40
    plain.close()

    exchange: list[float] = []
    sent: list[int] = []
    state: list[int] = []
    real = elastic_loader.start_allgather

    def timed(manager, mine, slot, slots, capacity):
        t = time.perf_counter()
        got = real(manager, mine, slot, slots, capacity)
        exchange.append(time.perf_counter() - t)  # started, not waited for
        sent.append(got.buf.numel() if got.buf is not None else 0)
        state.append(len(mine or b""))
        return got

    elastic_loader.start_allgather = timed  # type: ignore[assignment]
    Path(out + ".ready").touch()
    while not os.path.exists(out + ".go"):
        time.sleep(0.01)
    model = {"w": torch.zeros(1024)}
    manager = local_manager(lighthouse, rid, lambda sd: model.update(sd), lambda: dict(model))
    if mode == "elastic":
        loader: Any = ElasticLoader(
            manager,
            lambda r, n: TokenLoader(build, rank=r, world_size=n),
            exchange_capacity=None if capacity == "none" else int(capacity),
            exchange_every=int(every),
        )
    else:  # the reference: a fixed share per group, nothing followed or exchanged
        loader = _Fixed(TokenLoader(build, rank="abc".index(rid), world_size=3))
    # the reference in the same run: a plain TokenLoader on a fixed share, its next() timed
    # in every step right after the elastic one (same process, same load, nothing followed)
    shadow = iter(TokenLoader(build, rank="abcd".index(rid) % 3, world_size=3))
    with open(out, "a") as f:
        f.write(json.dumps({"plain_next": plain_next}) + "\n")
        while True:
            t_start = t = time.perf_counter()
            manager.start_quorum()
            n = manager.num_participants()
            t_quorum = time.perf_counter() - t
            resplits = loader.resplits
            exchanges = len(sent)
            t = time.perf_counter()
            try:
                batch = next(loader)
            except StopIteration:
                break
            t_next = time.perf_counter() - t
            t = time.perf_counter()
            next(shadow, None)
            t_shadow = time.perf_counter() - t
            step, taking = manager.current_step(), manager.is_participating()
            rows = [] if batch is None or not taking else np.asarray(batch["provenance"]).tolist()
            # the attempt, before the gradient leaves (a group killed after it is still counted)
            f.write(json.dumps({"step": step, "taking": taking, "rows": rows, "n": n}) + "\n")
            f.flush()
            grad = torch.ones(1024)
            t = time.perf_counter()
            manager.allreduce(grad).wait()
            t_grad = time.perf_counter() - t
            time.sleep(0.005)  # the model's step
            committed = manager.should_commit()
            t_step = time.perf_counter() - t_start
            f.write(json.dumps({
                "step": step, "n": n, "committed": committed, "taking": taking,
                "t_quorum": t_quorum, "t_next": t_next, "t_grad": t_grad, "t_step": t_step,
                "t_shadow": t_shadow, "exchanged": len(sent) > exchanges,
                "t_exchange": sum(exchange[exchanges:]), "sent": sum(sent[exchanges:]),
                "state": sum(state[exchanges:]), "resplit": loader.resplits != resplits,
            }) + "\n")  # fmt: skip
            f.flush()
    loader.close()
    manager.shutdown(wait=False)


def _batches(data: str) -> int:
    return int(Path(data, ".batches").read_text())


class _Fixed:
    """A plain TokenLoader in the ElasticLoader's place (the reference run)."""

    resplits = 0

    def __init__(self, loader: Any) -> None:
        self.loader, self.it = loader, iter(loader)

    def __next__(self) -> Any:
        return next(self.it)

    def close(self) -> None:
        self.loader.close()


# -- the job -------------------------------------------------------------------------------------
def run_job(
    tmp: str, data: str, mode: str = "elastic", capacity: str = "none", every: int = 50
) -> dict[str, list[dict]]:
    """The job (``mode="elastic"``: the kill-and-join timeline; ``"fixed"``: 3 groups with
    plain loaders, nobody killed, for 1/3 of the epoch): each group's step records."""
    from torchdata_ext.torchft.local import start_lighthouse, stop_job

    lighthouse = start_lighthouse(min_replicas=2)
    outs = {
        rid: Path(tmp) / f"{mode}-{rid}.jsonl" for rid in ("abcd" if mode == "elastic" else "abc")
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = {
        rid: subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--replica",
                lighthouse.address(),
                data,
                str(out),
                rid,
                mode,
                capacity,
                str(every),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(f"{out}.err", "w"),  # noqa: SIM115
        )  # fmt: skip
        for rid, out in outs.items()
    }
    try:
        while not all(Path(f"{o}.ready").exists() for o in outs.values()):
            time.sleep(0.05)
        for rid in "abc":
            Path(f"{outs[rid]}.go").touch()
        total = None
        while mode == "fixed":
            done = (len(read_step_log(outs["a"])) - 1) // 2
            if done >= _batches(data) // 3:
                for p in procs.values():
                    p.kill()
                    p.wait()
                break
            time.sleep(0.05)
        while mode == "elastic":  # kill c at 1/6 of the epoch, start d at 1/3
            done = (len(read_step_log(outs["a"])) - 1) // 2
            if total is None and done > 0:
                total = _batches(data)
            if total and done >= total // 6 and procs["c"].poll() is None:
                procs["c"].send_signal(signal.SIGKILL)
            if total and done >= total // 3:
                Path(f"{outs['d']}.go").touch()
                break
            time.sleep(0.02)
        for rid in "abd" if mode == "elastic" else "":
            procs[rid].wait(timeout=600)
    finally:
        stop_job(procs, lighthouse)
    return {rid: read_step_log(out) for rid, out in outs.items()}


def delivered_tokens(recs: dict[str, list[dict]], lengths: dict) -> tuple[int, int]:
    """(tokens delivered more than once, tokens never delivered) over the committed steps."""
    from torchdata_ext.torchft.local import committed_attempts

    committed = committed_attempts(recs.values())
    count: dict = {k: np.zeros(n, np.int32) for k, n in lengths.items()}
    names = ["web", "code"]
    for rs in recs.values():
        last = {(r["step"], r["n"]): r for r in rs if "rows" in r}
        for key, r in last.items():
            if key in committed and r["taking"]:
                for row in r["rows"]:
                    for ds, f, d, start, n in row:
                        if ds >= 0:
                            count[(names[ds], f, d)][start : start + n] += 1
    repeated = sum(int(np.maximum(c - 1, 0).sum()) for c in count.values())
    missing = sum(int((c == 0).sum()) for c in count.values())
    return repeated, missing


def sampler_side_by_side(lengths: dict, steps_per_epoch: int) -> dict[str, int]:
    """torchft's DistributedSampler on the same timeline: 3 replica groups, one document a
    sample, each group's batch the same share of the epoch per step; c dies at 1/6 of the
    epoch (the step it dies in fails for all: its batches were drawn and are not trained),
    d takes c's replica_rank at 1/3 and starts its sampler over; the job ends with a and b's
    samplers (the end of the epoch for them)."""
    from torchft.data import DistributedSampler

    docs = list(lengths.values())
    samplers = [
        list(DistributedSampler(docs, replica_rank=g, num_replica_groups=3, group_rank=0,
                                num_replicas=1, shuffle=True, seed=0))
        for g in range(3)
    ]  # fmt: skip
    per_group = len(samplers[0])
    batch = max(1, per_group // steps_per_epoch)
    die, join = steps_per_epoch // 6, steps_per_epoch // 3
    seen: list[int] = []
    pos = {"a": 0, "b": 0, "c": 0}
    for step in range(steps_per_epoch):
        groups = ["a", "b"] + (["c"] if step <= die else []) + (["d"] if step >= join else [])
        for g in groups:
            share = samplers[{"a": 0, "b": 1, "c": 2, "d": 2}[g]]
            if g == "d" and "d" not in pos:
                pos["d"] = 0  # a new sampler: from the start of the share
            took = share[pos[g] : pos[g] + batch]
            pos[g] += batch
            if step != die:  # the failed step: drawn, not trained
                seen.extend(took)
    tokens = np.asarray(docs)
    n_seen = np.bincount(np.asarray(seen, dtype=np.int64), minlength=len(docs))
    return {
        "samples_repeated": int(np.maximum(n_seen - 1, 0).sum()),
        "samples_skipped": int((n_seen == 0).sum()),
        "tokens_repeated": int((np.maximum(n_seen - 1, 0) * tokens).sum()),
        "tokens_skipped": int(((n_seen == 0) * tokens).sum()),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--replica":
        replica(*sys.argv[2:9])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=4000)
    p.add_argument("--capacity", default="none", help="exchange_capacity (none: exact sizes)")
    p.add_argument("--every", type=int, default=50, help="exchange_every")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        lengths = write_corpus(data, a.docs)
        from torchdata_ext import TokenLoader
        from torchdata_ext.pipeline.build import build_pipeline

        n_rows = sum(
            len(b["provenance"])
            for b in TokenLoader(functools.partial(build_pipeline, config(data)))
        )
        Path(data, ".batches").write_text(str(n_rows // 3 // 4))  # a group's steps, about
        fixed = run_job(tmp, data, "fixed")
        recs = run_job(tmp, data, "elastic", a.capacity, a.every)
    timed = [r for rs in recs.values() for r in rs if "t_next" in r]
    steady = [r for r in timed if r["taking"] and not r["resplit"] and r["step"] > 2]
    quiet = [r for r in steady if not r["exchanged"]]
    ex = [r for r in steady if r["exchanged"]]
    changed = [r for r in timed if r["resplit"]]
    plain = np.mean([rs[0]["plain_next"] for rs in recs.values() if rs])
    ms = lambda xs: float(np.median(xs)) * 1e3  # noqa: E731
    print(f"epoch: {n_rows} rows, {sum(lengths.values())} tokens, {len(lengths)} documents")
    print(f"plain TokenLoader next() before the job: {plain * 1e3:.3f} ms")
    print(
        f"step without an exchange ({len(quiet)} steps): next() {ms([r['t_next'] for r in quiet]):.3f}"
        f" ms median vs the same run's plain next() {ms([r['t_shadow'] for r in quiet]):.3f} ms; "
        f"added {ms([r['t_next'] - r['t_shadow'] for r in quiet]):.3f} ms (median of the "
        f"per-step differences)"
    )
    print(
        f"exchange step ({len(ex)} steps, every {a.every}): next() {ms([r['t_next'] for r in ex]):.2f}"
        f" ms median, vs plain {ms([r['t_shadow'] for r in ex]):.3f} ms"
    )
    mean_added = np.mean([r["t_next"] - r["t_shadow"] for r in steady]) * 1e3
    print(
        f"added per unchanged step, mean over all of them (exchanges amortized): {mean_added:.3f} ms"
    )
    state = np.median([r["state"] for r in ex if r["n"] == 3]) if ex else 0
    sent = np.median([r["sent"] for r in ex if r["n"] == 3]) if ex else 0
    per_step = np.mean([r["sent"] for r in steady])
    print(
        f"state per participant: {state:.0f} bytes (pickled, zlib); all-reduced in an exchange "
        f"at 3 groups: {sent:.0f} bytes; per step on average: {per_step:.0f} bytes"
    )
    print(
        "quorum change -> batch (re-split and replay in next()): "
        + ", ".join(f"{r['t_next'] * 1e3:.1f} ms (n={r['n']}, step {r['step']})" for r in changed)
    )
    ref = [r for rs in fixed.values() for r in rs if "t_step" in r and r["step"] > 2]
    mine = [r for r in quiet if r["n"] == 3]
    print(
        f"whole step at 3 groups, median: {ms([r['t_step'] for r in mine]):.2f} ms with this "
        f"loader (no exchange), {ms([r['t_step'] for r in ref]):.2f} ms with a plain TokenLoader "
        f"per group (a separate run of the same torchft loop, {len(ref)} steps)"
    )
    print(
        f"torchft's quorum per step (start_quorum -> num_participants): "
        f"{ms([r['t_quorum'] for r in steady]):.2f} ms median"
    )
    # 1,000 groups x 8 workers: a state per worker as here (one worker a group here)
    k, groups, workers = a.every, 1000, 8
    slot = 16 + workers * state
    print(
        f"at {groups} groups x {workers} workers, exchange every {k}: {groups * slot / 1e6:.1f} MB "
        f"all-reduced per exchange, {groups * slot / k / 1e3:.0f} KB per step on average "
        f"(every step: {groups * slot / 1e6:.1f} MB); nothing in the other steps; at a change a "
        f"share replays at most {k - 1} steps of the ~2 old shares it succeeds: "
        f"<= {2 * (k - 1) * plain:.2f} s of next() at this machine's {plain * 1e3:.1f} ms a batch"
    )
    repeated, missing = delivered_tokens(recs, lengths)
    print(f"this loader: tokens repeated {repeated}, tokens never delivered {missing}")
    steps = max(r["step"] for rs in recs.values() for r in rs if "step" in r)
    print(f"DistributedSampler, same timeline: {sampler_side_by_side(lengths, steps)}")


if __name__ == "__main__":
    main()
