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


# 4+2 steps: with 2+1, the streamed fill's first rows are all one long code document and the
# example's check that the loss goes on smoothly after the resume compares too few steps
@pytest.mark.slow
def test_the_main_example_needs_no_extra(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-c", _RUN_BLOCKED, ",".join(EXTRAS), str(EXAMPLE), "--steps", "4",
         "--resume-steps", "2", "--max-files", "64", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "OK: trained 4+2 steps" in res.stdout
