"""A built wheel, installed into a fresh virtual environment, runs from an empty folder: the configs ship inside it."""

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

import pytest

from conftest import CONF_DIR, REPO, clean_environ

# slow: builds a wheel and starts a dozen interpreters; one test process builds and installs it for all.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("install")]

SHORT = ["trainer.max_steps=3", "data.num_samples=256", "data.val_samples=64", "trainer.log_every_n_steps=1"]


@dataclass
class Installed:
    venv: Path
    wheel: Path
    empty: Path  # an empty folder, away from the repository: nothing to import from there

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {k: v for k, v in clean_environ().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '')}"
        return subprocess.run(args, cwd=self.empty, env=env, capture_output=True, text=True, timeout=timeout)

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


def _build_wheel(out: Path) -> Path:
    # Offline: the setuptools of this environment builds it (without it, pip fetches one from the index).
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    sources = _clean_sources(out.parent / "src")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(out),
                           str(sources)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    (wheel,) = out.glob("runner-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The wheel installed with --no-deps into a new virtual environment that sees this one's dependencies."""
    root = tmp_path_factory.mktemp("install")
    wheel = _build_wheel(root / "dist")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                           "--no-deps", str(wheel)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (site_packages,) = venv.glob("lib/python*/site-packages")
    # Plain paths in a .pth file go to the end of sys.path: the wheel's runner comes first, torch is reused.
    (site_packages / "dependencies.pth").write_text("\n".join(_site_packages_of_this_environment()) + "\n")
    empty = root / "empty"
    empty.mkdir()
    return Installed(venv, wheel, empty)


def test_the_wheel_holds_every_config_and_only_the_runner_package(installed: Installed) -> None:
    names = zipfile.ZipFile(installed.wheel).namelist()
    shipped = {n.removeprefix("runner/conf/") for n in names if n.startswith("runner/conf/") and n.endswith(".yaml")}
    assert shipped == {p.relative_to(CONF_DIR).as_posix() for p in CONF_DIR.rglob("*.yaml")}
    assert {n.split("/")[0] for n in names} == {"runner", "runner-0.1.0.dist-info"}, "no top-level experiments/"
    assert "runner/examples/shapes.py" in names


def test_the_sdist_holds_every_config(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                           "print(build_meta.build_sdist(sys.argv[1]))", str(tmp_path)],
                          cwd=_clean_sources(tmp_path / "src"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (sdist,) = tmp_path.glob("runner-*.tar.gz")
    with tarfile.open(sdist) as archive:
        members = {m.split("/", 1)[1] for m in archive.getnames() if "/" in m}
    assert {f"runner/conf/{p.relative_to(CONF_DIR).as_posix()}" for p in CONF_DIR.rglob("*.yaml")} <= members


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
