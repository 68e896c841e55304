"""Every exception the docs tell users to catch is importable from ``torchdata_ext`` itself."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torchdata_ext

ROOT = Path(__file__).resolve().parent.parent
_NAME = re.compile(r"\b([A-Z][A-Za-z]*(?:Error|Exception))\b")
# other libraries' exceptions that the docs name, and where they live
_FOREIGN = {"CheckpointException": "torch.distributed.checkpoint"}


def documented_errors() -> set[str]:
    """Exception names (``...Error``/``...Exception``) that README.md or docs/*.md name, less
    Python's built-in ones and other libraries' (:data:`_FOREIGN`)."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    names: set[str] = set()
    for path in texts:
        names.update(_NAME.findall(path.read_text(encoding="utf-8")))
    return names - set(dir(__import__("builtins"))) - set(_FOREIGN)


@pytest.mark.parametrize("name", sorted(_FOREIGN))
def test_foreign_errors_the_docs_name_are_where_the_table_says(name: str) -> None:
    assert isinstance(getattr(importlib.import_module(_FOREIGN[name]), name), type)


def test_the_docs_name_the_errors_users_catch() -> None:
    # the finder finds what the docs say today: a wrong pattern would make the next test vacuous
    assert {"ChangedFilesError", "StaleIndexError", "DataFileError"} <= documented_errors()
    assert "ValueError" not in documented_errors()


@pytest.mark.parametrize("name", sorted(documented_errors()))
def test_a_documented_error_imports_from_the_root(name: str) -> None:
    assert name in torchdata_ext.__all__, f"add {name} to torchdata_ext's __all__ and _MODULE_OF"
    err = getattr(torchdata_ext, name)
    assert isinstance(err, type) and issubclass(err, Exception)
    assert err.__module__.startswith("torchdata_ext."), err.__module__


def test_root_errors_are_the_ones_raised() -> None:
    from torchdata_ext.remote.retry import RemoteError
    from torchdata_ext.sources.fingerprint import ChangedFilesError

    assert torchdata_ext.ChangedFilesError is ChangedFilesError
    assert torchdata_ext.RemoteError is RemoteError


def test_the_old_fingerprint_path_still_imports_with_a_warning() -> None:
    # in a fresh interpreter: the module's warning fires once, at its first import
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    from torchdata_ext.fingerprint import ChangedFilesError\n"
        "import torchdata_ext\n"
        "assert ChangedFilesError is torchdata_ext.ChangedFilesError\n"
        "assert any(issubclass(x.category, DeprecationWarning) and 'sources.fingerprint' in"
        " str(x.message) for x in w), [str(x.message) for x in w]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    assert importlib.util.find_spec("torchdata_ext.fingerprint") is not None
