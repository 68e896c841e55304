"""The main example runs on the base install: none of the optional extras (README command 1
installs the package alone, command 2 adds the test extras)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_tiny_lm.py"
# top-level modules of the extras (s3, text, zstd, yaml, test) and what they pull in
EXTRAS = ("s3fs", "tokenizers", "zstandard", "yaml", "pytest", "hypothesis", "moto", "boto3",
          "botocore", "aiobotocore", "ruff", "mypy")  # fmt: skip

_RUN_BLOCKED = """
import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # as if not installed: import fails, importlib.util.find_spec is None
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# the example's fast mode as test_examples runs the others (8+4 steps, 70 files), with the
# extras blocked: one run checks both (it was a 4+2-step run of its own, 8-24 s more)
@pytest.mark.slow
def test_the_main_example_needs_no_extra(tmp_path: Path) -> None:
    """Prepare (cli, in-process) -> pipeline -> train -> DCP + folder checkpoint -> resume with
    3 workers (rescale) -> train, on the base install: provenance matches the files, nothing
    repeated, loss goes on."""
    res = subprocess.run(
        [sys.executable, "-c", _RUN_BLOCKED, ",".join(EXTRAS), str(EXAMPLE), "--steps", "8",
         "--max-files", "70", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "sequences on rank 0 equal the tokens their provenance names" in out
    assert ", 0 repeated (2 workers -> checkpoint -> 3 workers)" in out
    assert "OK: trained 8+4 steps, resumed from DCP + loader checkpoint with 3 workers" in out
    assert f"checkpoints kept in {tmp_path / 'ckpt'} (and the corpus in {tmp_path})" in out
    assert (tmp_path / "code" / "meta" / "torchdata_ext_counts.csv").exists()
