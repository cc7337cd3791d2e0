"""Python's collector while a process of the command starts (runner.collector): paused until the modules the config
names are imported, then on, with what start-up made frozen; a program calling the runner keeps its own.

Launched workers are checked beside the grad_norm test's DDP run (tests/test_hooks.py)."""

from __future__ import annotations

import gc
import subprocess
import weakref
import sys
from pathlib import Path
from typing import Callable

import pytest
from omegaconf import DictConfig, OmegaConf

import runner
from conftest import TINY, clean_environ
from hook_fixtures import events
from runner import collector
from runner.cli import RunFolders

TESTS = Path(__file__).resolve().parent


class Cycle:
    """An object in a reference cycle: freed by the collector alone."""

    def __init__(self, other: object) -> None:
        self.other, self.me = other, self
RECORDER = ("+callbacks.rec._target_=hook_fixtures.Recorder",)


def test_the_command_imports_the_configs_modules_paused_and_trains_collecting(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "runner", *TINY, *RECORDER, f"+callbacks.rec.folder={tmp_path}",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                          env={**clean_environ(), "PYTHONPATH": str(TESTS)}, timeout=120)
    assert done.returncode == 0, done.stderr
    end = events(tmp_path)[-1]
    assert end["hook"] == "on_fit_end"
    assert not end["collecting_at_import"] and end["collecting"] and end["frozen"] > 0, end


def test_a_program_calling_the_runner_keeps_its_own_collector(make_cfg: Callable[..., DictConfig],
                                                              tmp_path: Path) -> None:
    assert gc.isenabled() and gc.get_freeze_count() == 0  # the test process's, as any program's
    runner.fit(make_cfg(*RECORDER, f"+callbacks.rec.folder={tmp_path}"), run_dir=tmp_path / "run")
    end = events(tmp_path)[-1]
    assert end["collecting"] and end["frozen"] == 0, end
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_sweeps_driver_collects_from_its_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver of `-m` runs as long as its jobs, which a launcher plugin runs in other processes."""
    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))  # the test process keeps its collector as it was
    collector.pause()
    try:
        assert not gc.isenabled()
        RunFolders().on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}}))
        assert gc.isenabled() and frozen == [True]
        collector.resume()  # once only
        assert frozen == [True]
    finally:
        gc.enable()


@pytest.mark.parametrize("made", [20_000, 2_000], ids=["past-the-bound", "within-it"])
def test_a_start_that_made_much_of_its_own_collects_before_the_freeze(made: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A module that builds data at import, with cycles: past `COLLECT_ABOVE` objects they are collected, not
    frozen with the imports."""
    freed_at_freeze = []
    # the test process keeps its collector as it was; what the freeze would have kept is read as it comes
    monkeypatch.setattr(gc, "freeze", lambda: freed_at_freeze.append(garbage() is None))
    monkeypatch.setattr(collector, "COLLECT_ABOVE", 10_000)
    collector.pause()
    try:
        cycle: list = []
        cycle.append(cycle)
        garbage = weakref.ref(Cycle(cycle))
        del cycle
        built = [[] for _ in range(made)]
        collector.resume()
        assert freed_at_freeze == [made > 10_000] and len(built) == made
    finally:
        gc.enable()
