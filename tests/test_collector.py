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
    frozen, before = [], gc.get_threshold()
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))  # the test process keeps its collector as it was
    collector.pause()
    try:
        assert gc.get_threshold()[0] == 0
        RunFolders().on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}}))
        assert gc.get_threshold() == before and frozen == [True]
        collector.resume()  # once only
        assert frozen == [True]
    finally:
        gc.set_threshold(*before)


CHOICES = {"none": lambda: None, "turned-off": gc.disable, "thresholds": lambda: gc.set_threshold(500, 5, 5)}


@pytest.mark.parametrize("choice", CHOICES)
def test_the_starts_garbage_is_freed_and_a_modules_own_collector_settings_kept(choice: str,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A module that drops a cycle holding much memory while it is imported: freed when the start ends, not frozen
    with the imports. A module that turns the collector off, or sets its thresholds, while it is imported keeps that."""
    before = gc.get_threshold()
    monkeypatch.setattr(gc, "freeze", lambda: None)  # the test process keeps its objects in the collector's sight
    collector.pause()
    try:
        assert gc.isenabled() and gc.get_threshold() == (0, *before[1:])
        garbage = weakref.ref(Cycle(bytearray(10**7)))
        CHOICES[choice]()
        collector.resume()
        assert garbage() is None
        assert gc.isenabled() == (choice != "turned-off")
        assert gc.get_threshold() == ((500, 5, 5) if choice == "thresholds" else before)
    finally:
        gc.enable()
        gc.set_threshold(*before)
