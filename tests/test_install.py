"""Installs into fresh virtual environments: the wheel (built from the sdist, as pip builds one) runs from an empty
folder with the configs inside it; an editable install reads the top-level conf/ and experiments/ in place."""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from conftest import REPO, clean_environ

# slow: builds an sdist and a wheel, makes two environments and starts a dozen interpreters; one test process
# builds and installs them for all.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("install")]

SHORT = ["trainer.max_steps=3", "data.num_samples=256", "data.val_samples=64", "trainer.log_every_n_steps=1"]


@dataclass
class Installed:
    venv: Path
    empty: Path  # an empty folder, away from the repository: nothing to import from there
    wheel: Optional[Path] = None
    sdist: Optional[Path] = None
    sources: Optional[Path] = None  # the copy an editable install points at

    def run(self, *args: str, timeout: float = 120, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in clean_environ().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '')}"
        return subprocess.run(args, cwd=cwd or self.empty, env=env, capture_output=True, text=True, timeout=timeout)

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")


def _site_packages_of_this_environment() -> list[str]:
    """Where torch, Hydra and the other dependencies are installed here (and not the repository itself)."""
    return [p for p in sys.path if Path(p).is_dir() and Path(p).name in ("site-packages", "dist-packages")]


def _clean_sources(dest: Path) -> Path:
    """The project without build leftovers: a stale build/ or *.egg-info/ would put files in that the
    package-data settings leave out."""
    skip = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "outputs", "multirun",
                                  "__pycache__", ".pytest_cache")
    return Path(shutil.copytree(REPO, dest, ignore=skip))


# Offline: the setuptools of this environment builds (without it, pip fetches one from the index).
ISOLATION = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []


def _build_sdist_then_wheel(out: Path) -> tuple[Path, Path]:
    """The sdist from a clean copy, then the wheel from the sdist: what `python -m build` and pip do."""
    done = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                           "print(build_meta.build_sdist(sys.argv[1]))", str(out)],
                          cwd=_clean_sources(out.parent / "src"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (sdist,) = out.glob("runner-*.tar.gz")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *ISOLATION, "-q", "-w", str(out),
                           str(sdist)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    (wheel,) = out.glob("runner-*.whl")
    return sdist, wheel


def _venv_with(root: Path, *install: str) -> Installed:
    """A new virtual environment with `pip install --no-deps <install>` that sees this one's dependencies."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    (site_packages,) = venv.glob("lib/python*/site-packages")
    # Plain paths in a .pth file go to the end of sys.path: the installed runner comes first, torch is reused, and
    # an editable install's build (pip runs it in the new environment) finds this environment's setuptools.
    (site_packages / "dependencies.pth").write_text("\n".join(_site_packages_of_this_environment()) + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                           "--no-deps", *install], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    empty = root / "empty"
    empty.mkdir()
    return Installed(venv, empty)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The wheel installed into a new virtual environment."""
    root = tmp_path_factory.mktemp("install")
    sdist, wheel = _build_sdist_then_wheel(root / "dist")
    env = _venv_with(root, str(wheel))
    env.sdist, env.wheel = sdist, wheel
    return env


def _repo_files(folder: str, pattern: str) -> set[str]:
    """The repository's files under `folder` (conf, experiments, runner) matching `pattern`, relative to it."""
    return {p.relative_to(REPO / folder).as_posix() for p in (REPO / folder).rglob(pattern)
            if "__pycache__" not in p.parts}


def test_the_wheel_holds_every_config_every_example_and_every_module(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    shipped = {n.removeprefix("runner/conf/") for n in names if n.startswith("runner/conf/") and n.endswith(".yaml")}
    assert shipped == _repo_files("conf", "*.yaml")
    assert "runner/conf/__init__.py" in names
    assert {f"runner/examples/{name}" for name in _repo_files("experiments", "*.py")} <= names
    missing = {f"runner/{name}" for name in _repo_files("runner", "*.py")} - names
    assert not missing, f"add their packages to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"
    assert {n.split("/")[0] for n in names} == {"runner", "runner-0.1.0.dist-info"}, "no top-level conf/ or experiments/"


def test_the_sdist_holds_every_config_and_every_example(installed: Installed) -> None:
    with tarfile.open(installed.sdist) as archive:
        members = {m.split("/", 1)[1] for m in archive.getnames() if "/" in m}
    assert {f"conf/{name}" for name in _repo_files("conf", "*.yaml")} <= members
    assert {f"experiments/{name}" for name in _repo_files("experiments", "*.py")} <= members
    assert "conf/__init__.py" in members


def test_the_default_experiment_runs_from_an_empty_folder(installed: Installed) -> None:
    where = installed.run(installed.python, "-c", "import runner; print(runner.__file__)")
    assert where.stdout.strip().startswith(str(installed.venv)), where.stdout + where.stderr
    result = installed.run(installed.python, "-m", "runner", "trainer.max_steps=3")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    (metrics,) = (installed.empty / "outputs").glob("*/*/metrics.json")
    assert json.loads(metrics.read_text())["step"] == 3
    assert (metrics.parent / "tensorboard").is_dir() and (metrics.parent / "checkpoints" / "last.ckpt").is_file()


def test_the_runner_script_lists_the_built_in_groups(installed: Installed) -> None:
    result = installed.run(str(installed.venv / "bin" / "runner"), "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "strategy: auto, ddp, dp, fsdp, single" in result.stdout
    assert "experiment: " in result.stdout and "shapes" in result.stdout


def test_a_two_job_sweep_runs_from_an_empty_folder(installed: Installed) -> None:
    sweep = installed.empty / "sweep"
    result = installed.run(str(installed.venv / "bin" / "runner"), "-m", "optimizer.lr=0.1,0.01",
                           f"hydra.sweep.dir={sweep}", *SHORT)
    assert result.returncode == 0, result.stderr
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"]) for r in rows] == [("0", "ok"), ("1", "ok")]


def test_torchrun_runs_the_installed_package(installed: Installed) -> None:
    run_dir = installed.empty / "torchrun"
    result = installed.run(installed.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "runner", "strategy=ddp", "accelerator=cpu", "trainer.devices=2",
                           f"hydra.run.dir={run_dir}", *SHORT)
    assert result.returncode == 0, result.stderr
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == 3
    assert (run_dir / "rank_1.log").is_file()


@pytest.fixture(scope="module")
def editable(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """`pip install -e` of a copy of the sources (the copy's files are edited, never the repository's)."""
    root = tmp_path_factory.mktemp("editable")
    sources = _clean_sources(root / "src")
    env = _venv_with(root, *ISOLATION, "-e", str(sources))
    env.sources = sources
    return env


PROBE_MODEL = '''"""A model written after the install: found only if experiments/ is read in place."""
import torch


class Probe(torch.nn.Linear):
    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__(in_features, num_classes)
'''


def test_an_editable_install_imports_the_top_level_folders_of_its_sources(editable: Installed) -> None:
    where = editable.run(editable.python, "-c", "import runner, runner.conf, runner.examples.shapes as s; "
                         "print(runner.__file__, runner.conf.__file__, s.__file__, sep='\\n')")
    assert where.returncode == 0, where.stderr
    src = editable.sources
    assert where.stdout.split() == [str(src / "runner" / "__init__.py"), str(src / "conf" / "__init__.py"),
                                    str(src / "experiments" / "shapes.py")]


def test_an_editable_install_reads_conf_and_experiments_in_place(editable: Installed) -> None:
    """Edited and new files show at once, from an empty folder and from the sources' root, with no reinstall."""
    src = editable.sources
    trainer = src / "conf" / "trainer" / "default.yaml"
    assert "\nmax_steps: -1" in trainer.read_text()
    trainer.write_text(trainer.read_text().replace("\nmax_steps: -1", "\nmax_steps: 2"))
    (src / "experiments" / "probe.py").write_text(PROBE_MODEL)
    (src / "conf" / "model" / "probe.yaml").write_text(
        "_target_: runner.examples.probe.Probe\nin_features: ${data.num_features}\nnum_classes: ${data.num_classes}\n")
    for cwd in (editable.empty, src):
        run_dir = editable.empty / f"run-{cwd.name}"
        result = editable.run(editable.python, "-m", "runner", "model=probe", "data.num_samples=256",
                              "data.val_samples=64", f"hydra.run.dir={run_dir}", cwd=cwd)
        assert result.returncode == 0, result.stderr
        assert json.loads((run_dir / "metrics.json").read_text())["step"] == 2  # the edited default
        assert "runner.examples.probe.Probe" in (run_dir / ".hydra" / "config.yaml").read_text()


def test_pyproject_lists_every_package_of_the_runner() -> None:
    """The package list is explicit (conf/ and experiments/ are mapped into the package): a new subpackage of
    runner/ missing from it would be left out of every wheel, with the checkout still working. Read without a
    build, so that this fails in a second."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "runner").rglob("__init__.py")
               if "__pycache__" not in p.parts}
    assert on_disk - listed == set()
