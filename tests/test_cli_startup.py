"""The command line starts without the library: ``--help`` and argument errors import no torch.

``import torchdata_ext`` hands its public names on lazily (PEP 562) and ``cli.py`` imports the
library inside the command that needs it, so ``torchdata-ext index --help`` or a mistyped flag
answers in a fraction of a second instead of the ~3 s torch takes to import.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "pyarrow", "torchdata", "fsspec")


def _imported(*args: str) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The top-level modules ``python -X importtime -m torchdata_ext ARGS`` imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "torchdata_ext", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    names = set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names, proc


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("index", "--help"),
        ("prepare", "--help"),
        ("audit", "--help"),
        ("inspect", "--help"),
    ],  # fmt: skip
    ids=lambda a: " ".join(a),
)
def test_help_imports_no_heavy_module(args: tuple[str, ...]) -> None:
    names, proc = _imported(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: torchdata-ext" in proc.stdout
    assert "torchdata_ext" in names  # the measurement itself works
    assert not names & set(HEAVY), f"--help imported {sorted(names & set(HEAVY))}"


def test_an_argument_error_imports_no_heavy_module() -> None:
    names, proc = _imported("index")  # DATA_PATH missing
    assert proc.returncode == 2
    assert "the following arguments are required: data_path" in proc.stderr
    assert not names & set(HEAVY), f"an argument error imported {sorted(names & set(HEAVY))}"


def test_the_package_imports_its_public_names_lazily() -> None:
    code = (
        "import sys, torchdata_ext as t; assert 'torch' not in sys.modules; "
        "from torchdata_ext import TokenLoader, prepare, __all__; "
        "assert 'torch' in sys.modules; "
        "missing = [n for n in __all__ if getattr(t, n, None) is None]; "
        "assert not missing, missing; assert set(__all__) <= set(dir(t)); print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        import torchdata_ext

        torchdata_ext.nothing_here  # noqa: B018
