"""The package's modules import each other without cycles, counting imports inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import torchdata_ext

PACKAGE = "torchdata_ext"
ROOT = Path(torchdata_ext.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it names in an import statement (at any depth).

    ``from a.b import c`` counts as importing ``a.b.c`` when that is a module, else ``a.b``;
    the implicit import of parent packages is not counted (every module would import the root),
    nor are imports under ``if TYPE_CHECKING:`` (type annotations only, never run).
    """
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
                node.body = []  # ast.walk visits the children after this: drop them
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    deps.add(full if full in files else node.module)
        graph[name] = {d for d in deps if d in files and d not in (name, PACKAGE)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*path[path.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert "torchdata_ext.state.graph" in graph["torchdata_ext.loader.token_loader"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_layers() -> None:
    """The loader knows nothing of checkpoints or rescaling; the CLI only calls the libraries."""
    graph = import_graph()
    checkpoints = {
        "torchdata_ext.checkpoint.folder",
        "torchdata_ext.checkpoint.dcp",
        "torchdata_ext.checkpoint.restore",
    }
    assert (
        not {*checkpoints, "torchdata_ext.checkpoint.rescale"}
        & graph["torchdata_ext.loader.token_loader"]
    )
    assert not checkpoints & graph["torchdata_ext.checkpoint.rescale"]
    importers_of_cli = {m for m, deps in graph.items() if "torchdata_ext.cli" in deps}
    assert importers_of_cli == {"torchdata_ext.__main__"}


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_building_a_token_pipeline_does_not_import_pyarrow_compute(tmp_path: Path) -> None:
    """Every dataloader worker builds its pipeline before its first batch; pyarrow.compute takes
    ~80 ms to import (more than the rest of the build), and token data never needs it. Run in a
    fresh interpreter, as a worker started by ``spawn`` is, so nothing imported it before."""
    import subprocess
    import sys

    from harness import write_random_arrow_datasets

    write_random_arrow_datasets(str(tmp_path), (("a", 30, 40), ("b", 30, 40)), seed=5)
    script = f"""
import sys
from torchdata_ext import PipelineConfig, World, build_pipeline
cfg = PipelineConfig(data_path={str(tmp_path)!r}, datasets=["a", "b"], weights=[1, 1],
                     seq_length=16, batch_size=2, shuffle_buffer=4, eos_token=0, logical_shards=4)
batch = next(iter(build_pipeline(cfg, World())))
assert batch["input_ids"].shape == (2, 16), batch["input_ids"].shape
print(sorted(m for m in sys.modules if m.startswith("pyarrow.compute")))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_forked_workers_import_nothing_of_numpy_pyarrow_fsspec_or_this_package(
    tmp_path: Path,
) -> None:
    """What a worker imports on its way to its first batch is imported once, in the training
    process, before the workers fork (``token_loader.WORKER_IMPORTS``): NumPy's lazily loaded
    ``numpy.random`` alone is ~8 ms per worker (``numpy.ma``, ~9 ms more, is not on the list:
    nothing on the way may load it). Each forked worker finds a
    module added to the list already imported, and records the modules it imported between
    the start of its build and its first batch: none may be NumPy's, pyarrow's, fsspec's or
    this package's. Fresh interpreter: nothing imported them before."""
    import subprocess
    import sys

    from harness import write_random_arrow_datasets

    write_random_arrow_datasets(str(tmp_path), (("a", 30, 40), ("b", 30, 40)), seed=5)
    script = f"""
import functools, os, sys
from torchdata_ext import PipelineConfig, TokenLoader, World, build_pipeline
from torchdata_ext.loader import token_loader

OUT = {str(tmp_path / "imported")!r}
assert "colorsys" not in sys.modules  # a module nothing here imports: on the list, it must be
token_loader.WORKER_IMPORTS = (*token_loader.WORKER_IMPORTS, "colorsys")  # imported pre-fork

class Recording:
    def __init__(self, cfg):
        self.cfg = cfg

    def __call__(self, world):
        before = set(sys.modules)
        with open(f"{{OUT}}.listed.{{world.worker_id}}", "w") as f:
            f.write(str("colorsys" in before))
        node = build_pipeline(self.cfg, world)
        first = node.next_packed_batch

        def next_packed_batch():
            out = first()
            new = sorted(set(sys.modules) - before)
            with open(f"{{OUT}}.{{world.worker_id}}", "w") as f:
                f.write("\\n".join(new))
            node.next_packed_batch = first
            return out

        node.next_packed_batch = next_packed_batch
        return node

cfg = PipelineConfig(data_path={str(tmp_path)!r}, datasets=["a", "b"], weights=[1, 1],
                     seq_length=16, batch_size=2, shuffle_buffer=4, eos_token=0, logical_shards=4)
loader = TokenLoader(Recording(cfg), num_workers=2, multiprocessing_context="fork")
batch = next(iter(loader))
assert batch["input_ids"].shape == (2, 16), batch["input_ids"].shape
loader.close()
"""
    subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    for worker in (0, 1):
        assert (tmp_path / f"imported.listed.{worker}").read_text() == "True"
        imported = (tmp_path / f"imported.{worker}").read_text().split()
        ours = [
            m
            for m in imported
            if m.split(".")[0] in ("numpy", "pyarrow", "fsspec", "torchdata_ext")
        ]
        assert ours == [], (worker, ours)
