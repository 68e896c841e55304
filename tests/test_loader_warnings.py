"""The user's console: torchdata's own noise on every loader start is kept out of it
(``'set_vital' is deprecated``, the worker-count warning twice per start), the user's warnings
are not."""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from torchdata_ext import DatasetIndex, ShardReader, World
from torchdata_ext.loader.token_loader import TokenLoader
from torchdata_ext.testing import write_arrow_batches


def build(root: str, world: World) -> ShardReader:
    warnings.warn("the user's own warning, from their build function", UserWarning, stacklevel=1)
    return ShardReader(DatasetIndex.build(root), 4, world=world, block_docs=2, seed=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [0, 2])
def test_only_the_users_warnings_reach_the_console(tmp_path, monkeypatch, workers) -> None:
    docs = [np.arange(1, 5, dtype=np.uint32) + i for i in range(16)]
    write_arrow_batches(str(tmp_path / "web" / "a.arrow"), docs)
    monkeypatch.setattr(torch._utils, "cpu_count", lambda: 1)  # so torch finds 2 workers many
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # pytest's own filters (pyproject) are off here
        loader = TokenLoader(functools.partial(build, str(tmp_path / "web")), num_workers=workers)
        for _ in zip(range(3), loader):
            pass
        warnings.warn("the user's warning between loader starts", UserWarning, stacklevel=1)
        for _ in zip(range(3), loader):
            pass
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "set_vital" in m or "worker processes in total" in m]
    assert "the user's warning between loader starts" in messages
    if workers == 0:  # the build function runs in this process, inside the loader's start
        assert "the user's own warning, from their build function" in messages


@pytest.mark.slow
def test_the_bamba_example_prints_no_warning() -> None:
    """The example no longer filters warnings itself; its console has none."""
    example = Path(__file__).resolve().parent.parent / "examples" / "bamba_config.py"
    res = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "Warning" not in res.stderr and "warn" not in res.stderr.lower(), res.stderr


_AT_EXIT = """
import atexit, threading  # registered first, so run after the package's exit callback
atexit.register(lambda: print("alive at exit:", [t.name for t in threading.enumerate()
                                                 if t.name == "TokenLoader" and t.is_alive()]))
import functools, sys
import numpy as np
from torchdata_ext import PipelineConfig, TokenLoader, build_pipeline
from torchdata_ext.loader import token_loader  # a module named in __main__: torn down first
from torchdata_ext.testing import write_arrow_batches

root = sys.argv[1]
write_arrow_batches(root + "/web/a.arrow", [np.arange(1, 50, dtype=np.uint32) + i for i in range(64)])
cfg = PipelineConfig(data_path=root, datasets=["web"], seq_length=16, batch_size=2,
                     shuffle_buffer=4, logical_shards=4, eos_token=0)
loader = TokenLoader(functools.partial(build_pipeline, cfg), num_workers=int(sys.argv[2]))
next(iter(loader))
if sys.argv[3] == "close":
    loader.close()
print("done")
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("close", ["close", "leave"])
def test_a_loader_alive_at_exit_leaves_a_quiet_console(tmp_path, workers, close) -> None:
    """A loader still referenced at the interpreter's exit (closed or not) ends without an
    ``Exception ignored in ... __del__`` on stderr (its module's globals may be gone then),
    and its thread is stopped before the interpreter finalizes: a daemon thread still in a
    torch call then ended about 1 exit in 30 in ``std::terminate`` (status -6) on a loaded
    machine."""
    res = subprocess.run(
        [sys.executable, "-c", _AT_EXIT, str(tmp_path / "data"), str(workers), close],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["done", "alive at exit: []"], res.stdout
    assert "Exception ignored" not in res.stderr and "Traceback" not in res.stderr, res.stderr
