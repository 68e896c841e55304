"""An error a function raises and its caller catches leaves nothing of the caller's alive.

A function that keeps the error it raises in a local makes a cycle (error -> traceback -> its
frame -> error) through every frame the error passed, the caller's included: what the caller
held (a loader, with its worker processes and shared memory) stayed alive until Python's cyclic
collector happened to run. Each place that raises an error it kept is listed here."""

from __future__ import annotations

import errno
import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

from torchdata_ext.remote import RemoteError, with_retries
from torchdata_ext.remote.urls import expand_urls
from torchdata_ext.sources.fingerprint import _gather
from torchdata_ext.sources.index_file import shared_by_rank0


class _Owned:  # stands for what a caller holds
    pass


def _boom() -> None:
    raise OSError("the store is gone")


@pytest.fixture
def one_rank(tmp_path) -> Iterator[None]:
    """A one-rank gloo process group in this process (the collectives of the rank-0 and
    gathered startup reads), ended after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _freed_without_the_collector(call: Callable[[], object]) -> None:
    def caller(owned: _Owned) -> None:
        try:  # noqa: SIM105 - a caller that catches
            call()
        except Exception:
            pass

    owned = _Owned()
    ref = weakref.ref(owned)
    gc.collect()
    gc.disable()
    try:
        caller(owned)
        del owned
        assert ref() is None, "freed only by the cyclic collector"
    finally:
        gc.enable()


@pytest.mark.parametrize("error", [FileNotFoundError, PermissionError], ids=["as-is", "explained"])
def test_a_permanent_error_with_retries_raises_at_once(error) -> None:
    """A side file that does not exist (raised as it is), refused access (explained):
    ``with_retries`` raises at once."""

    def fail() -> None:
        raise error(errno.EACCES, "no", "s3://bucket/meta/counts.csv")

    with pytest.raises(FileNotFoundError if error is FileNotFoundError else RemoteError):
        with_retries(fail, "s3://bucket/meta/counts.csv")
    _freed_without_the_collector(lambda: with_retries(fail, "s3://bucket/meta/counts.csv"))


def test_no_data_files_found(tmp_path) -> None:
    (tmp_path / "data").mkdir()
    with pytest.raises(FileNotFoundError, match="no data files match"):
        expand_urls([str(tmp_path / "data")], suffixes=(".arrow",))
    _freed_without_the_collector(
        lambda: expand_urls([str(tmp_path / "data")], suffixes=(".arrow",))
    )


def test_a_rank_failing_a_gathered_read(one_rank) -> None:
    with pytest.raises(OSError, match="gone"):
        _gather(_boom, 1, "read the data files")
    _freed_without_the_collector(lambda: _gather(_boom, 1, "read the data files"))


def test_rank_0_failing_the_read_it_shares(one_rank) -> None:
    with pytest.raises(OSError, match="gone"):
        shared_by_rank0(_boom, "list the data files")
    _freed_without_the_collector(lambda: shared_by_rank0(_boom, "list the data files"))


def test_every_error_kept_in_a_local_is_dropped_when_raised() -> None:
    """The package's source: each ``raise name`` of an error held in a function's local (not
    an ``except ... as name``, which Python drops itself) sits in a ``try`` whose ``finally``
    deletes it, so a new one cannot bring the cycle back."""
    import ast
    from pathlib import Path

    import torchdata_ext

    bad = []
    for path in sorted(Path(torchdata_ext.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Name)):
                continue
            name, up, dropped = node.exc.id, parents.get(node), False
            func = up
            while func is not None and not isinstance(
                func, (ast.FunctionDef, ast.AsyncFunctionDef)
            ):
                func = parents.get(func)
            assigned = {
                t.id
                for n in ast.walk(func) if func is not None
                for t in ast.walk(n) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.NamedExpr))
                if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)
            }  # fmt: skip
            if name not in assigned:  # a class (raise StopIteration) or a global
                continue
            while up is not None and not isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if isinstance(up, ast.ExceptHandler) and up.name == name:
                    dropped = True  # Python deletes an ``except ... as name`` itself
                if isinstance(up, ast.Try) and any(
                    isinstance(s, ast.Delete)
                    and any(getattr(t, "id", None) == name for t in s.targets)
                    for s in up.finalbody
                ):
                    dropped = True
                up = parents.get(up)
            if not dropped:
                bad.append(f"{path.name}:{node.lineno}: raise {name}")
    assert not bad, bad
