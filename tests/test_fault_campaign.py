"""The randomized kill campaign (``benchmarks/fault_campaign.py``) with a small count: a 2-rank
torchrun loop SIGKILLed at random moments (start-up, steps, inside ``save_checkpoint``) and
restored on other topologies, every token of every document delivered exactly once. The full
campaign (>= 20 trials) is run by hand; its figures are in docs/reliability.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_kill_campaign_with_a_small_count(tmp_path) -> None:
    script = os.path.join(ROOT, "benchmarks", "fault_campaign.py")
    out = subprocess.run(
        [sys.executable, script, "--trials", "2", "--seed", "3", "--workdir", str(tmp_path / "w")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines[:3]] == ["trial_001", "trial_002", "final"]
    assert re.match(r"trial_001: 2 rank\(s\) x 2 worker\(s\), started fresh, SIGKILL", lines[0])
    assert "summary: 2 trials, each SIGKILLed" in out.stdout
    assert re.search(r"tokens: [\d,]+ delivered, 0 missing, 0 repeated", out.stdout)
    assert (
        "row structure (separators, BOS/EOS once per document, pieces ending rows): "
        "no problem" in out.stdout
    )
    assert "OK: every token of every document delivered exactly once" in out.stdout
