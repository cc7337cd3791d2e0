"""The runner's modules import one another one way only: no cycle, read from the source with `ast`.

Every `import` and `from ... import` counts, at any depth of a file (a function's lazy import too): a cycle
hidden in a function still means two modules that cannot be understood, or changed, one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "runner"


def module_names(package: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of `package` (a package by its `__init__.py`)."""
    names = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported(node: ast.AST, module: str, is_package: bool, names: dict[str, Path]) -> list[str]:
    """The dotted names an import statement loads: `from a import b` loads module a.b if there is one, else a."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the module's own package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base for alias in node.names]


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (the longest known prefix of each imported name)."""
    names = module_names(package)
    graph: dict[str, set[str]] = {}
    for module, path in names.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for name in _imported(node, module, path.name == "__init__.py", names):
                while name and name not in names:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_in_the_runner() -> None:
    graph = import_graph(PACKAGE)
    assert len(graph) > 40  # every module was read
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        " <-> ".join(component) + "\n  " + "\n  ".join(f"{m} imports {sorted(graph[m] & set(component))}"
                                                     for m in component)
        for component in found)


def package_graph(graph: dict[str, set[str]], package: Path) -> dict[str, set[str]]:
    """The import graph with each subpackage of `package` (a layer of the house: checks, data, loop, ...) as one
    node beside the top-level modules."""
    def node(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 and (package / parts[1]).is_dir() else module

    folded: dict[str, set[str]] = {}
    for module, targets in graph.items():
        folded.setdefault(node(module), set()).update(node(t) for t in targets if node(t) != node(module))
    return folded


def test_no_layer_imports_one_above_it() -> None:
    """Each package is a layer: one that imports a module of another, which imports it back, runs back up a layer
    (a check calling back into the builder, the loop into the builder that made it)."""
    graph = import_graph(PACKAGE)
    folded = package_graph(graph, PACKAGE)
    found = cycles(folded)
    assert not found, "layers that import each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_layers_that_import_each_other_are_found(tmp_path: Path) -> None:
    """The check itself: two packages whose modules import each other (no module cycle) are one."""
    package = tmp_path / "pkg"
    for sub in ("low", "high"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "high" / "a.py").write_text("from pkg.low import b\n")
    (package / "low" / "b.py").write_text("x = 1\n")
    (package / "low" / "c.py").write_text("def f():\n    from pkg.high import a\n")
    graph = import_graph(package)
    assert cycles(graph) == [] and cycles(package_graph(graph, package)) == [["pkg.high", "pkg.low"]]


def test_strategies_do_not_know_how_processes_are_created() -> None:
    """A strategy names the processes it needs (`Strategy.processes`); the job picks the launcher."""
    graph = import_graph(PACKAGE)
    process_side = {"runner.launch", "runner.entry", "runner.worker", "runner.job"}
    for module, targets in graph.items():
        if module.startswith("runner.strategies"):
            assert not targets & process_side, (module, targets & process_side)
    assert "runner.worker" not in graph["runner.launch"]  # workers are started by module name


@pytest.mark.parametrize("late", [False, True])
def test_a_cycle_is_found_at_any_depth(tmp_path: Path, late: bool) -> None:
    """The check itself: a cycle through a function's lazy import, or a relative import, is reported."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .b import thing\n")
    (package / "a.py").write_text("from pkg.sub.b import thing\n")
    body = "def f():\n    if True:\n        from pkg import a\n" if late else "from .. import a\n"
    (package / "sub" / "b.py").write_text("thing = 1\n" + body)
    (package / "c.py").write_text("import pkg.a\n")
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.sub.b"]]
    (package / "sub" / "b.py").write_text("thing = 1\n")
    assert cycles(import_graph(package)) == []
