"""Checks apart from builders: runner.build alone calls hydra.utils.instantiate and imports no check; the checks and
the job read the pieces the plan works out once from the plan; the command line reads the key checks without torch.
Read from the source with `ast`, as tests/test_imports.py reads it."""

from __future__ import annotations

import ast
import subprocess
import sys

from test_imports import PACKAGE, import_graph


def _instantiate_callers() -> set[str]:
    """The modules that import `instantiate` from hydra.utils or call `hydra.utils.instantiate`."""
    callers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            imported = (isinstance(node, ast.ImportFrom) and node.module == "hydra.utils"
                        and any(alias.name == "instantiate" for alias in node.names))
            called = isinstance(node, ast.Attribute) and node.attr == "instantiate" and ast.unparse(node.value) in (
                "hydra.utils", "utils")
            if imported or called:
                callers.add(path.relative_to(PACKAGE.parent).as_posix())
    return callers


def test_the_builders_are_the_one_caller_of_instantiate() -> None:
    assert _instantiate_callers() == {"runner/build.py"}


def test_the_builders_import_no_check() -> None:
    graph = import_graph(PACKAGE)
    assert {"runner.checks", "runner.checks.keys", "runner.checks.components"} <= set(graph)  # the package was read
    assert not {m for m in graph["runner.build"] if m.startswith("runner.checks")}


# What runner.plan works out once from the config, with the functions of the builders (and runner.values) that work
# each out: a check or the job that called one of these would build or read again what the others read from the plan.
PLANNED = {
    "runner.build": {"build_accelerator", "build_environment", "devices_setting", "build_strategy", "build_task",
                     "logger_specs", "meta_model"},
    "runner.values": {"optimizer_nodes"},
    "runner.checkpoint_search": {"resolve_ckpt_path"},
    "runner.stages": {"record_dir"},
    "runner.launch": {"launcher_for"},
}


def _planned_imports(path) -> set[str]:
    """The functions of PLANNED that the module at `path` imports, at any depth."""
    return {alias.name for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.ImportFrom) and node.module in PLANNED
            for alias in node.names if alias.name in PLANNED[node.module]}


def test_the_checks_and_the_job_read_the_planned_pieces_from_the_plan() -> None:
    readers = [*sorted((PACKAGE / "checks").glob("*.py")), PACKAGE / "job.py"]
    assert len(readers) > 10  # the package was read
    found = {path.relative_to(PACKAGE.parent).as_posix(): names for path in readers if (names := _planned_imports(path))}
    assert found == {}
    assert _planned_imports(PACKAGE / "plan.py") == set().union(*PLANNED.values())


def test_the_command_line_reads_the_key_checks_without_torch() -> None:
    """`python -m runner --help` and a refused override answer before torch is imported (a second or more)."""
    code = ("import sys, runner.cli, runner.checks.keys; "
            "print(sorted(m for m in ('torch', 'runner.build', 'runner.checks.components') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
