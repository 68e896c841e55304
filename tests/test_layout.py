"""The package's layout rules, checked on the code itself so a new module cannot slip past them.

* the package root holds the shared nouns only: at most 12 modules;
* no function is over 120 lines;
* no module is over 600 lines unless its docstring says why, with its true size ("N lines");
  any size a module docstring states is its true size (within 5%);
* no module imports another module's underscore names (what is shared is public within the
  package, with a plain name);
* every sub-package's ``__init__`` says what the folder is for;
* imports between folders (and the root's modules) run one way: no cycle of folders.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from test_imports import import_graph

PACKAGE = Path(__file__).resolve().parent.parent / "torchdata_ext"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_ROOT_MODULES = 12
MAX_FUNCTION_LINES = 120
MAX_MODULE_LINES = 600
# a module's own size, as its docstring states it: "This module is 612 lines"
SIZE_CLAIM = re.compile(r"[Tt]his module is\s+(?:about\s+)?([\d,]+)\s+lines")


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _old_path(path: Path) -> bool:
    """A deprecated alias kept for an old import path (it re-exports a module and warns): not
    a module of its own."""
    text = path.read_text(encoding="utf-8")
    return "import *" in text and "DeprecationWarning" in text and len(text.splitlines()) < 40


def test_root_holds_only_the_shared_nouns() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py") if not _old_path(p))
    assert len(root) <= MAX_ROOT_MODULES, (
        f"{len(root)} modules at the package root ({', '.join(root)}): at most "
        f"{MAX_ROOT_MODULES}; put a new module in the folder of its concern (docs/DESIGN.md)"
    )


def long_functions(path: Path) -> list[str]:
    return [
        f"{node.name} (line {node.lineno}, {node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def size_problems(path: Path) -> list[str]:
    size = _lines(path)
    doc = ast.get_docstring(_tree(path)) or ""
    claims = [int(c.replace(",", "")) for c in SIZE_CLAIM.findall(doc)]
    problems = [
        f"its docstring says {claim} lines, it has {size}: make it true"
        for claim in claims
        if abs(claim - size) > 0.05 * size
    ]
    if size > MAX_MODULE_LINES and not claims:
        problems.append(
            f"{size} lines (over {MAX_MODULE_LINES}): split it, or say why in its docstring "
            f"('This module is {size} lines because ...')"
        )
    return problems


def private_imports(path: Path) -> list[str]:
    bad = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchdata_ext"):
            bad += [
                f"{node.module}.{a.name} (line {node.lineno})"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    return bad


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_no_function_over_the_limit(path: Path) -> None:
    long = long_functions(path)
    assert not long, f"{_rel(path)}: over {MAX_FUNCTION_LINES} lines: {long}; name its stages"


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_module_size_is_in_bounds_or_explained_truly(path: Path) -> None:
    problems = size_problems(path)
    assert not problems, f"{_rel(path)}: {problems}"


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_no_module_imports_another_modules_private_names(path: Path) -> None:
    bad = private_imports(path)
    assert not bad, f"{_rel(path)} imports private names {bad}: give the shared ones plain names"


@pytest.mark.parametrize("init", sorted(PACKAGE.rglob("__init__.py")), ids=_rel)
def test_every_folder_says_what_it_is_for(init: Path) -> None:
    assert ast.get_docstring(_tree(init)), f"{_rel(init)}: one docstring line saying what it holds"


def test_the_layout_rules_can_fail(tmp_path: Path) -> None:
    """Each check finds what it is meant to find (a rule that cannot fail checks nothing)."""
    module = tmp_path / "m.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + MAX_MODULE_LINES))
    module.write_text(
        '"""This module is 3 lines."""\n'
        "from torchdata_ext.nodes.pack import _private, Pack\n"
        f"def long():\n{body}\n"
    )
    assert [f.split(" ")[0] for f in long_functions(module)] == ["long"]
    assert len(size_problems(module)) == 1 and "says 3 lines" in size_problems(module)[0]
    assert private_imports(module) == ["torchdata_ext.nodes.pack._private (line 2)"]
    module.write_text(f"def long():\n{body}\n")
    assert "split it" in size_problems(module)[0]
    module.write_text(
        f'"""This module is {MAX_MODULE_LINES + 200} lines: why."""\n' + "x = 1\n" * 797
    )
    assert size_problems(module) == []


def folder_of(module: str) -> str:
    """``torchdata_ext.nodes.pack`` -> ``nodes``; a root module is its own folder."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def folder_cycles(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    folders: dict[str, set[str]] = {}
    for module, deps in graph.items():
        for dep in deps:
            if folder_of(module) != folder_of(dep):
                folders.setdefault(folder_of(module), set()).add(folder_of(dep))

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            for nxt in folders.get(todo.pop(), ()):
                if nxt == b:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    return sorted((a, b) for a, deps in folders.items() for b in deps if reaches(b, a))


def test_imports_between_folders_run_one_way() -> None:
    cycles = folder_cycles(import_graph())
    assert not cycles, f"folders that import each other (directly or around): {cycles}"
    looped = {
        "torchdata_ext.a.x": {"torchdata_ext.b.y"},
        "torchdata_ext.b.y": {"torchdata_ext.a.z"},
    }
    assert folder_cycles(looped) == [("a", "b"), ("b", "a")]
