"""Kill at any moment, many times: a randomized SIGKILL campaign against a torchrun training loop.

A stand-in training loop (this file with ``--loop``, under ``torchrun``; gloo on CPU) runs the
full pipeline (two sub-datasets interleaved 2:1, packed into 32-token sequences, a shuffle
buffer) through :class:`~torchdata_ext.TokenLoader`, in lockstep across ranks like a DDP step
(one ``all_reduce`` per step), logs every packed sequence's provenance (fsynced, so it survives
a kill) and saves a folder checkpoint every ``--every`` steps into a folder of its own.

The campaign starts it on 2 ranks x 2 workers and, per trial, SIGKILLs the whole process tree
(torchrun, the ranks and their dataloader workers) at a random moment: while it starts or
restores, between steps, or while it is inside ``save_checkpoint``. The next trial restores from
the last complete checkpoint (a folder with a manifest) on a random other topology (ranks x
workers). After the trials, a last run on another topology finishes the epoch. Then every token
of every document must have been delivered exactly once: the deliveries of each run up to the
checkpoint the next run restored from, plus all of the last run's, checked token by token
against the documents written. Folders left by kills during a save must be refused by
``load_checkpoint`` (no manifest).

    python benchmarks/fault_campaign.py --trials 20 --seed 0

Prints a line per trial and a summary (trials, kills during save, topologies, outcome); exits 1
if any token was missing or repeated, or a run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from torchdata_ext import PipelineConfig, TokenLoader, build_pipeline
from torchdata_ext.audit.row_check import RowRules, row_problems
from torchdata_ext.checkpoint.folder import load_checkpoint, save_checkpoint
from torchdata_ext.provenance import PAD
from torchdata_ext.testing import write_arrow_batches

DATASETS = ("web", "code")
TOPOLOGIES = ((1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (3, 0), (3, 1))
FIRST = (2, 2)
DOCS_PER_TRIAL = 60  # enough data that the epoch outlasts the trials
STEP_TIMEOUT_S = 120.0  # a run that shows no progress for this long has hung


# -- the training loop (one rank, under torchrun) -----------------------------------------------
def make_config(data: str) -> PipelineConfig:
    return PipelineConfig(
        data_path=data, datasets=",".join(DATASETS), weights="2,1", seq_length=32,
        eos_token=0, bos_token=1, logical_shards=24, shuffle_buffer=8, block_docs=3, epochs=1,
        mix_quantum_tokens=0, seed=7,
    )  # fmt: skip


def complete_checkpoints(ckpt: str) -> list[int]:
    """Steps of the checkpoint folders ``step_<n>`` of ``ckpt`` that have a manifest."""
    names = os.listdir(ckpt) if os.path.isdir(ckpt) else []
    return sorted(
        int(n.split("_")[1])
        for n in names
        if n.startswith("step_") and os.path.exists(os.path.join(ckpt, n, "manifest.json"))
    )


def run_loop(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = TokenLoader(
        functools.partial(build_pipeline, make_config(args.data), collate=False),
        num_workers=args.workers,
    )
    picked = [complete_checkpoints(args.ckpt)[-1:] or [0]]
    dist.broadcast_object_list(picked, src=0)  # one decision for all ranks
    step = int(picked[0][0])
    if step:
        load_checkpoint(loader, os.path.join(args.ckpt, f"step_{step:06d}"))
    with open(os.path.join(args.trace, f"rank{rank}.txt"), "a") as log:

        def say(line: str) -> None:
            log.write(line + "\n")
            log.flush()
            os.fsync(log.fileno())

        say(f"RESUME {step}")
        it = iter(loader)
        exhausted = False
        while True:
            seq = None
            if not exhausted:
                seq = next(it, None)
                exhausted = seq is None
            alive = torch.tensor([0 if exhausted else 1])
            dist.all_reduce(alive)  # lockstep, as a DDP gradient all-reduce would make it
            if int(alive.item()) == 0:
                break
            step += 1
            rows = [] if seq is None else np.asarray(seq["provenance"]).tolist()
            # the whole row (document pieces and the BOS/EOS the packer placed, not padding):
            # the campaign checks its structure too, not only the tokens
            say(f"{step} " + " ".join(",".join(map(str, r)) for r in rows if r[0] != PAD and r[4]))
            if step % args.every == 0:
                say(f"SAVE {step} {time.time():.6f}")
                save_checkpoint(loader, os.path.join(args.ckpt, f"step_{step:06d}"))
                say(f"SAVED {step} {time.time():.6f}")
        say("END")
    dist.destroy_process_group()


# -- the campaign ------------------------------------------------------------------------------
@dataclass
class Trial:
    """One run of the loop, and how it ended."""

    name: str
    topology: tuple[int, int]
    resumed_at: int = 0
    plan: str = ""
    moment: str = ""  # where the kill landed: "startup/restore", "steps" or "save"
    last_step: int = 0
    restart_from: int = 0  # the last complete checkpoint after the run
    incomplete: list[str] = field(default_factory=list)  # checkpoint folders without manifest
    refused: int = 0  # of those, refused by load_checkpoint right after the kill
    seconds: float = 0.0
    finished: bool = False


def write_corpus(data: str, n_docs: int, seed: int) -> dict[tuple[int, int, int], int]:
    """Two datasets of ``n_docs`` documents (2:1, as the weights), two files each; returns
    ``{(dataset, file, doc): tokens}``."""
    rng = np.random.default_rng(seed)
    lengths = {}
    for ds, name in enumerate(DATASETS):
        n = n_docs * (2 - ds) // 3
        docs = [rng.integers(5, 30_000, 1 + int(rng.exponential(12)), np.uint32) for _ in range(n)]
        for f in range(2):
            part = docs[f::2]
            write_arrow_batches(os.path.join(data, name, f"p{f}.arrow"), part)
            lengths.update({(ds, f, d): len(doc) for d, doc in enumerate(part)})
    return lengths


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (torchrun starts each rank in a session of its own)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and all its descendants, parents first, and wait for ``proc``."""
    for pid in [proc.pid, *_children(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


class Logs:
    """The per-rank logs of one run, read as they grow."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.seen: list[tuple[float, int]] = []  # (time, rank 0's last step) when it changed

    def lines(self, rank: int) -> list[str]:
        path = os.path.join(self.folder, f"rank{rank}.txt")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            text = f.read()
        return text.split("\n")[:-1]  # a line cut by the kill has no newline: left out

    def all_ranks(self) -> list[list[str]]:
        names = sorted(n for n in os.listdir(self.folder) if n.startswith("rank"))
        return [self.lines(int(n[4:-4])) for n in names]


def _last_step(lines: list[str]) -> int:
    steps = [int(ln.split()[0]) for ln in lines if ln.split()[0].isdigit()]
    return max(steps, default=0)


def _moment(ranks: list[list[str]]) -> str:
    """Where the kill landed, from what the ranks logged."""
    if not any(ln.split()[0].isdigit() for lines in ranks for ln in lines):
        return "startup/restore"
    for lines in ranks:
        saves = [ln.split()[1] for ln in lines if ln.startswith("SAVE ")]
        saved = {ln.split()[1] for ln in lines if ln.startswith("SAVED ")}
        if saves and saves[-1] not in saved:
            return "save"
    return "steps"


class Campaign:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = np.random.default_rng(args.seed)
        self.root = args.workdir
        self.data = os.path.join(self.root, "data")
        self.ckpt = os.path.join(self.root, "ckpt")
        self.trials: list[Trial] = []
        self.startup_s = [4.0]  # launch to first step, seconds (estimates, updated per run)
        self.save_s = [0.05]  # rank 0's SAVE -> SAVED
        self.step_s = [0.01]
        os.makedirs(self.ckpt, exist_ok=True)
        self.scratch = tempfile.mkdtemp(prefix="fault_campaign_tmp_")  # removed by close()

    def close(self) -> None:
        """Remove the runs' temporary folders (what the killed runs left in them)."""
        shutil.rmtree(self.scratch, ignore_errors=True)

    def launch(self, trial: Trial) -> tuple[subprocess.Popen, Logs, float]:
        ranks, workers = trial.topology
        log_dir = os.path.join(self.root, "logs", trial.name)
        os.makedirs(log_dir)
        here = os.path.dirname(os.path.abspath(__file__))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), env.get("PYTHONPATH", "")])
        # the run's temporary folder is the trial's: what a SIGKILLed run cannot remove
        # (torchrun's torchelastic_* folder, a fork server's pymp-*) goes with the campaign's
        # scratch folder (short: a socket's path in it must fit AF_UNIX's 108 bytes)
        env["TMPDIR"] = os.path.join(self.scratch, trial.name)
        os.makedirs(env["TMPDIR"])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", os.path.abspath(__file__), "--loop",
               "--data", self.data, "--ckpt", self.ckpt, "--trace", log_dir,
               "--workers", str(workers), "--every", str(self.args.every)]  # fmt: skip
        with open(os.path.join(log_dir, "torchrun.out"), "wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        return proc, Logs(log_dir), time.monotonic()

    def wait_for(self, proc, logs: Logs, done) -> bool:
        """Poll rank 0's log until ``done(lines)``; False if the run ended first."""
        last_change, seen = time.monotonic(), -1
        while proc.poll() is None:
            lines = logs.lines(0)
            if done(lines):
                return True
            if len(lines) != seen:
                last_change, seen = time.monotonic(), len(lines)
                step = _last_step(lines)
                if step and (not logs.seen or logs.seen[-1][1] != step):
                    logs.seen.append((last_change, step))
            if time.monotonic() - last_change > STEP_TIMEOUT_S:
                kill_tree(proc)
                raise RuntimeError(f"{logs.folder}: no progress for {STEP_TIMEOUT_S:.0f}s")
            time.sleep(0.003)
        return False

    def run_trial(self, trial: Trial) -> None:
        every = self.args.every
        trial.plan = str(self.rng.choice(["startup", "steps", "save"], p=[0.15, 0.45, 0.40]))
        resume = trial.resumed_at
        proc, logs, t0 = self.launch(trial)
        if trial.plan == "startup":
            delay = float(self.rng.uniform(0.0, float(np.median(self.startup_s))))
            reached = self.wait_for(proc, logs, lambda _: time.monotonic() - t0 >= delay)
        elif trial.plan == "steps":
            target = resume + int(self.rng.integers(1, 2 * every + 1))
            reached = self.wait_for(proc, logs, lambda ls: _last_step(ls) >= target)
            time.sleep(float(self.rng.uniform(0.0, float(np.median(self.step_s)))))
        else:
            target = (resume // every + int(self.rng.integers(1, 3))) * every
            saving = f"SAVE {target} "
            reached = self.wait_for(proc, logs, lambda ls: any(x.startswith(saving) for x in ls))
            time.sleep(float(self.rng.uniform(0.0, 1.5 * float(np.median(self.save_s)))))
        if reached:
            kill_tree(proc)
        else:
            proc.wait()
        trial.seconds = time.monotonic() - t0
        ranks = logs.all_ranks()
        trial.finished = bool(ranks) and all(ls and ls[-1] == "END" for ls in ranks)
        if not reached and not trial.finished:
            raise RuntimeError(f"{trial.name}: the run failed; see {logs.folder}/torchrun.out")
        trial.moment = "" if trial.finished else _moment(ranks)
        trial.last_step = max(_last_step(lines) for lines in ranks) if ranks else resume
        trial.restart_from = (complete_checkpoints(self.ckpt)[-1:] or [0])[0]
        self._learn(logs, t0)

    def _learn(self, logs: Logs, t0: float) -> None:
        """Update the timing estimates from what rank 0 logged (for the next kills)."""
        if logs.seen:
            self.startup_s.append(logs.seen[0][0] - t0)
        if len(logs.seen) > 1:
            (ta, sa), (tb, sb) = logs.seen[0], logs.seen[-1]
            self.step_s.append((tb - ta) / max(1, sb - sa))
        lines = logs.lines(0)
        saves = {ln.split()[1]: float(ln.split()[2]) for ln in lines if ln.startswith("SAVE ")}
        for ln in lines:
            if ln.startswith("SAVED ") and ln.split()[1] in saves:
                self.save_s.append(float(ln.split()[2]) - saves[ln.split()[1]])

    def run(self) -> bool:
        args = self.args
        lengths = write_corpus(self.data, DOCS_PER_TRIAL * (args.trials + 3), args.seed)
        topology = FIRST
        for k in range(1, args.trials + 1):
            resumed_at = (complete_checkpoints(self.ckpt)[-1:] or [0])[0]
            trial = Trial(f"trial_{k:03d}", topology, resumed_at)
            before = self._folders()
            self.run_trial(trial)
            trial.incomplete = self._left_incomplete(before)
            trial.refused = sum(self._refused(name) for name in trial.incomplete)
            self.trials.append(trial)
            print(self._describe(trial), flush=True)
            if trial.finished:
                break
            others = [t for t in TOPOLOGIES if t != topology]
            topology = others[int(self.rng.integers(len(others)))]
        if not self.trials[-1].finished:
            final = Trial("final", topology, (complete_checkpoints(self.ckpt)[-1:] or [0])[0])
            proc, logs, t0 = self.launch(final)
            self.wait_for(proc, logs, lambda _: False)
            final.seconds = time.monotonic() - t0
            ranks = logs.all_ranks()
            final.finished = bool(ranks) and all(ls and ls[-1] == "END" for ls in ranks)
            final.last_step = max(_last_step(lines) for lines in ranks) if ranks else 0
            self.trials.append(final)
            print(self._describe(final), flush=True)
            if not final.finished:
                print(f"FAILED: the last run did not finish; see {logs.folder}/torchrun.out")
                return False
        return self.verify(lengths)

    def _folders(self) -> dict[str, list[tuple[str, int]]]:
        """Each checkpoint folder's files and their modification times."""
        out = {}
        for name in os.listdir(self.ckpt):
            folder = os.path.join(self.ckpt, name)
            out[name] = sorted(
                (f, os.stat(os.path.join(folder, f)).st_mtime_ns) for f in os.listdir(folder)
            )
        return out

    def _left_incomplete(self, before: dict[str, list[tuple[str, int]]]) -> list[str]:
        """Checkpoint folders the last run wrote into and left without a manifest."""
        after = self._folders()
        return sorted(
            name
            for name, files in after.items()
            if files != before.get(name) and "manifest.json" not in {f for f, _ in files}
        )

    @staticmethod
    def _describe(t: Trial) -> str:
        ranks, workers = t.topology
        start = f"restored step {t.resumed_at}" if t.resumed_at else "started fresh"
        head = f"{t.name}: {ranks} rank(s) x {workers} worker(s), {start}"
        if t.finished:
            return f"{head}, ran to the end of the epoch (step {t.last_step}) in {t.seconds:.1f}s"
        left = f"; left {', '.join(t.incomplete)} incomplete" if t.incomplete else ""
        return (
            f"{head}, SIGKILL during {t.moment} at step {t.last_step} after "
            f"{t.seconds:.1f}s; last complete checkpoint: step {t.restart_from}{left}"
        )

    def delivered(self) -> list[list[np.ndarray]]:
        """The packed rows delivered (their provenance, padding left out), a stream per rank
        and run, each run counted up to the checkpoint the next restored."""
        out: list[list[np.ndarray]] = []
        for t, after in zip(self.trials, [*self.trials[1:], None]):
            cut = None if after is None else after.resumed_at
            for lines in Logs(os.path.join(self.root, "logs", t.name)).all_ranks():
                stream = []
                for ln in lines:
                    head, _, rest = ln.partition(" ")
                    if head.isdigit() and (cut is None or int(head) <= cut) and rest:
                        rows = [list(map(int, r.split(","))) for r in rest.split()]
                        stream.append(np.array(rows, np.int64).reshape(-1, 5))
                out.append(stream)
        return out

    def verify(self, lengths: dict[tuple[int, int, int], int]) -> bool:
        counts = {key: np.zeros(n, np.int64) for key, n in lengths.items()}
        unknown = 0
        streams = self.delivered()
        for stream in streams:
            for rows in stream:
                for ds, f, d, start, n in rows[rows[:, 0] >= 0].tolist():
                    if (ds, f, d) not in counts:
                        unknown += 1
                        continue
                    counts[(ds, f, d)][start : start + n] += 1
        # the rows' structure: separators, BOS/EOS once per document, pieces ending rows
        by_name = {(DATASETS[ds], f, d): n for (ds, f, d), n in lengths.items()}
        rules = RowRules.of(make_config(self.data))
        problems = row_problems([[(r, DATASETS) for r in st] for st in streams], by_name, rules)
        total = sum(lengths.values())
        missing = sum(int((c == 0).sum()) for c in counts.values())
        repeated = sum(int(np.maximum(c - 1, 0).sum()) for c in counts.values())
        refused = (sum(t.refused for t in self.trials), sum(len(t.incomplete) for t in self.trials))
        kills = [t for t in self.trials if not t.finished]
        moments = Counter(t.moment for t in kills)
        topologies = sorted({t.topology for t in self.trials})
        ok = (
            missing == 0
            and repeated == 0
            and unknown == 0
            and refused[0] == refused[1]
            and not problems
        )
        print(
            f"summary: {len(kills)} trials, each SIGKILLed: {moments['save']} during "
            f"save_checkpoint, {moments['steps']} between steps, {moments['startup/restore']} "
            f"during start-up or restore; then 1 run to the end of the epoch\n"
            f"topologies (ranks x workers): {' '.join(f'{r}x{w}' for r, w in topologies)}; "
            f"{len(self.trials)} runs, each restored on another topology than the run before\n"
            f"incomplete checkpoint folders left by kills: {refused[1]}, refused by "
            f"load_checkpoint: {refused[0]}; temporary files left by kills: {self._temporaries()} "
            "(hidden names, never a checkpoint file's)\n"
            f"{len(lengths):,} documents, {total:,} tokens: {total - missing:,} delivered, "
            f"{missing:,} missing, {repeated:,} repeated, {unknown} rows of unknown documents\n"
            f"row structure (separators, BOS/EOS once per document, pieces ending rows): "
            f"{'no problem' if not problems else f'{len(problems)} problems, e.g. ' + problems[0]}\n"
            + (
                "OK: every token of every document delivered exactly once in the epoch, in rows "
                "an uninterrupted run could have made"
                if ok
                else "FAILED: tokens missing or repeated (see above)"
            ),
            flush=True,
        )
        return ok

    def _temporaries(self) -> int:
        return sum(n.startswith(".") for _, _, names in os.walk(self.ckpt) for n in names)

    def _refused(self, name: str) -> bool:
        """Whether ``load_checkpoint`` refuses checkpoint folder ``name`` as incomplete."""
        build = functools.partial(build_pipeline, make_config(self.data), collate=False)
        try:
            load_checkpoint(TokenLoader(build, rank=0, world_size=1), os.path.join(self.ckpt, name))
        except FileNotFoundError as exc:
            return "save did not finish" in str(exc)
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=20, help="kill-and-restore trials")
    p.add_argument("--seed", type=int, default=0, help="data and kill moments")
    p.add_argument("--every", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--workdir", default=None, help="where to keep data, logs and checkpoints")
    p.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--trace", help=argparse.SUPPRESS)  # not --log: torchrun takes it
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.loop:
        run_loop(args)
        return 0
    if args.trials < 1:
        p.error("--trials must be >= 1")
    if args.every < 1:
        p.error("--every must be >= 1")
    tmp = None
    if args.workdir is None:
        tmp = args.workdir = tempfile.mkdtemp(prefix="fault_campaign_")
    elif os.path.exists(args.workdir) and os.listdir(args.workdir):
        p.error(f"--workdir {args.workdir} is not empty; give a new or empty folder")
    t0 = time.monotonic()
    campaign = Campaign(args)
    try:
        ok = campaign.run()
    finally:
        campaign.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"({time.monotonic() - t0:.0f}s, seed {args.seed})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
