"""How dataloader workers start by default: ``forkserver`` in a process whose start method is
``spawn`` (a trainer started by ``torch.multiprocessing.spawn``), torch's default otherwise.
Spawned workers import torch and this package again at every start of the workers (seconds
each, at every ``iter()`` and weight change); a fork server does that once."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.multiprocessing as tmp
from harness import take_batches, two_dataset_config

from torchdata_ext.loader.token_loader import TokenLoader, default_worker_context
from torchdata_ext.pipeline.build import build_pipeline


def test_forkserver_by_default_only_in_a_spawned_process(monkeypatch, tmp_path: Path) -> None:
    cfg = two_dataset_config(str(tmp_path))
    build = functools.partial(build_pipeline, cfg)
    monkeypatch.setattr(mp, "get_start_method", lambda allow_none=False: "fork")
    assert default_worker_context() is None
    assert "multiprocessing_context" not in TokenLoader(build, num_workers=2)._dl_kwargs
    monkeypatch.setattr(mp, "get_start_method", lambda allow_none=False: None)  # never set
    assert default_worker_context() is None
    monkeypatch.setattr(mp, "get_start_method", lambda allow_none=False: "spawn")
    assert TokenLoader(build, num_workers=2)._dl_kwargs["multiprocessing_context"] == "forkserver"
    # what the trainer asks for is kept; no workers, no context
    kept = TokenLoader(build, num_workers=2, multiprocessing_context="spawn")
    assert kept._dl_kwargs["multiprocessing_context"] == "spawn"
    assert "multiprocessing_context" not in TokenLoader(build, num_workers=0)._dl_kwargs


def _spawned_trainer(rank: int, root: str, out: str) -> None:
    """A trainer as ``torch.multiprocessing.spawn`` starts it: 2 workers, default context."""
    assert mp.get_start_method(allow_none=True) == "spawn"
    cfg = two_dataset_config(root)
    loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=2)
    assert loader._dl_kwargs["multiprocessing_context"] == "forkserver"
    batches = take_batches(loader, 12)
    np.save(out, np.stack([b["input_ids"].numpy() for b in batches]))


@pytest.mark.multiprocess
def test_a_spawned_trainer_gets_the_stream_of_forked_workers(tmp_path: Path) -> None:
    """Through a real ``torch.multiprocessing.spawn`` child (workers from a fork server) the
    batches are those of workers started by ``fork`` in this process."""
    root, out = str(tmp_path / "data"), str(tmp_path / "spawned.npy")
    cfg = two_dataset_config(root)
    want = take_batches(
        TokenLoader(
            functools.partial(build_pipeline, cfg), num_workers=2, multiprocessing_context="fork"
        ),
        12,
    )
    tmp.spawn(_spawned_trainer, args=(root, out), nprocs=1)
    got: Any = np.load(out)
    assert got.shape[0] == 12
    assert [g.tolist() for g in got] == [b["input_ids"].tolist() for b in want]


@pytest.mark.multiprocess
def test_a_temporary_folder_too_deep_for_the_fork_servers_socket_is_named(tmp_path: Path) -> None:
    """A fork server's socket goes in TMPDIR, and its path must fit AF_UNIX's 108 bytes: a
    job's deep TMPDIR gets one line naming the folder and what to do, not CPython's bare
    'AF_UNIX path too long' from inside the dataloader (a fresh process: no fork server yet)."""
    deep = tmp_path / ("t" * 90)
    deep.mkdir()
    data = tmp_path / "data"  # written by the first process
    script = (
        "import functools\n"
        "from harness import two_dataset_config\n"
        "from torchdata_ext import TokenLoader, build_pipeline\n"
        f"cfg = two_dataset_config({str(data)!r})\n"
        "loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=1,\n"
        "                     multiprocessing_context='forkserver')\n"
        "next(iter(loader))\n"
    )
    here = str(Path(__file__).parent)
    env = {**os.environ, "TMPDIR": str(deep), "PYTHONPATH": here}
    res = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 1, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("OSError: the dataloader's workers could not start"), last
    assert repr(str(deep)) in last and "set TMPDIR to a shorter folder" in last, last
    assert "multiprocessing_context='fork'" in last
    # with a short TMPDIR the same loader starts (the message's advice works)
    short = Path(tempfile.mkdtemp(prefix="fs-"))
    try:
        ok = subprocess.run(
            [sys.executable, "-c", script], env={**env, "TMPDIR": str(short)},
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert ok.returncode == 0, ok.stderr[-2000:]
    finally:
        shutil.rmtree(short, ignore_errors=True)
