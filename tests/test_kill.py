"""SIGKILL a training loop after a checkpoint, restart with another worker count: exactly once.

Run with the reader alone (documents checked) and with the full pipeline (interleave + pack +
shuffle buffer; every token of every document checked through the sequences' provenance).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from harness import check_exactly_once

from torchdata_ext.testing import write_arrow_batches

HERE = os.path.dirname(os.path.abspath(__file__))


def _kill_then_resume(data, tmp_path, extra: list[str]) -> list[str]:
    """Run the loop with 2 workers, SIGKILL it after 1-3 checkpoints, resume it with 3 workers
    from the last complete checkpoint; the items delivered, steps redone after the resume
    point counted once (from the resumed run)."""
    return [item for _, items in _timeline(data, tmp_path, extra) for item in items]


def _timeline(data, tmp_path, extra: list[str]) -> list[tuple[int | str, list[str]]]:
    """:func:`_kill_then_resume`'s run as it counts: ``(step, items)`` per step, with
    ``("CHECKPOINT n", [])`` where a checkpoint that counts was saved (the resume point, and
    those of the resumed run)."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.txt"
    ckpt.mkdir()
    script = os.path.join(HERE, "_train_loop.py")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, script, str(data), str(ckpt), str(log), "2", "5", *extra], env=env
    )
    kill_after = int(np.random.default_rng().integers(1, 4))  # checkpoints to wait for
    deadline = time.time() + 120
    while time.time() < deadline:
        text = log.read_text() if log.exists() else ""
        if text.count("CHECKPOINT") >= kill_after or "END" in text:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert "END" not in log.read_text(), "the run finished before the kill; make it longer"
    subprocess.run(
        [sys.executable, script, str(data), str(ckpt), str(log), "3", "5", "--resume", *extra],
        env=env, check=True, timeout=300,
    )  # fmt: skip
    # steps logged after the resumed checkpoint but before the kill were redone: drop them
    lines = log.read_text().splitlines()
    resume_at = int(next(ln for ln in lines if ln.startswith("RESUME")).split()[1])
    out: list[tuple[int | str, list[str]]] = []
    phase = "first"
    for ln in lines:
        head = ln.split()[0]
        if head == "RESUME":
            phase = "second"
        elif head.isdigit() and (phase == "second" or int(head) <= resume_at):
            out.append((int(head), ln.split()[1:]))
        elif head == "CHECKPOINT" and (phase == "second" or int(ln.split()[1]) == resume_at):
            out.append((ln, []))
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kill_and_restart_with_other_worker_count(tmp_path) -> None:
    rng = np.random.default_rng(0)
    data = tmp_path / "web"
    n_docs = 400
    docs = [
        np.concatenate([[10_000 + i], rng.integers(5, 999, 5)]).astype(np.uint32)
        for i in range(n_docs)
    ]
    for f in range(4):
        write_arrow_batches(str(data / f"p{f}.arrow"), docs[f * 100 : (f + 1) * 100])
    counts = collections.Counter(int(x) for x in _kill_then_resume(data, tmp_path, []))
    assert sorted(counts) == [10_000 + i for i in range(n_docs)]
    assert max(counts.values()) == 1


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kill_full_pipeline_and_restart_with_other_worker_count(tmp_path) -> None:
    rng = np.random.default_rng(1)
    lengths = {}
    for ds, (name, n_docs) in enumerate((("web", 240), ("code", 120))):
        docs = [
            rng.integers(5, 999, 1 + int(rng.exponential(10)), dtype=np.uint32)
            for _ in range(n_docs)
        ]
        for f in range(2):
            write_arrow_batches(str(tmp_path / "data" / name / f"p{f}.arrow"), docs[f::2])
            for d, doc in enumerate(docs[f::2]):
                lengths[(ds, f, d)] = len(doc)
    coverage: dict = {}
    delivered: collections.Counter = collections.Counter()
    fully: dict[int, set] = {}  # per checkpoint that counts: the documents delivered whole
    for step, items in _timeline(tmp_path / "data", tmp_path, ["--pipeline"]):
        if isinstance(step, str):
            n = int(step.split()[1])
            fully[n] = {k for k, v in delivered.items() if v == lengths[k]}
        for item in items:
            ds, f, d, start, length = map(int, item.split(","))
            coverage.setdefault((ds, f, d), []).append((start, start + length))
            delivered[(ds, f, d)] += length
    check_exactly_once(coverage, lengths)
    # the audit of two checkpoints (the resume point, saved at 2 workers, and the last one of
    # the resumed run, at 3): the documents that became consumed and not in flight between
    # them are exactly those whose last token was delivered between them
    from _train_loop import full_config

    from torchdata_ext.audit.report import audit_checkpoint

    first, last = min(fully), max(fully)
    assert last > first, "the resumed run saved no checkpoint; make it longer"
    settled = {}
    for n in (first, last):
        t = audit_checkpoint(
            str(tmp_path / "ckpt" / f"step_{n}"), full_config(str(tmp_path / "data"))
        ).documents()
        ids = {"web": 0, "code": 1}
        settled[n] = {
            (ids[ds], f, d)
            for ds, f, d, fl in zip(
                *(t[c].to_pylist() for c in ("dataset", "file_index", "doc", "in_flight"))
            )
            if not fl
        }
        assert settled[n] == fully[n]
    assert settled[last] - settled[first] == fully[last] - fully[first]
    assert len(settled[last]) > len(settled[first])
