"""User code that fails mid-run (a sample, a loader worker, a callback, a data hook under DDP) ends the run in one
line naming what failed, exit 1, its traceback in the run's log file. Real processes, real signals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_reliability import DDP2, TINY, start

BAD_SAMPLE = ("data._target_=faulty_user_code.BadSample",)


def _fails_in_one_line(run_dir: Path, args: tuple, cwd: Path) -> str:
    job = start(run_dir, *args, *TINY, cwd=cwd)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 1, stderr
    assert "Traceback" not in stderr and "Error executing job" not in stderr, stderr
    assert not (run_dir / "metrics.json").exists()
    assert "Traceback" in (run_dir / "runner.log").read_text()  # for the code's author
    return stderr


@pytest.mark.parametrize(("workers", "line"), [
    (0, r"error: reading a batch of data\.train_dataset raised ValueError: injected failure reading sample \d+\n"),
    (2, r"error: reading a batch of data\.train_dataset raised ValueError: injected failure reading sample \d+ "
        r"\(in loader worker \d\)\n"),
], ids=["in-process", "in-a-loader-worker"])
def test_a_sample_that_raises_is_one_line_naming_the_data_set(tmp_path: Path, workers: int, line: str) -> None:
    stderr = _fails_in_one_line(tmp_path / "run", (*BAD_SAMPLE, f"data.num_workers={workers}"), tmp_path)
    assert re.search(line, stderr), stderr


def test_a_loader_worker_killed_by_a_signal_is_one_line_naming_it(tmp_path: Path) -> None:
    """The sample SIGKILLs its own loader worker, as the out-of-memory killer would."""
    stderr = _fails_in_one_line(tmp_path / "run", (*BAD_SAMPLE, "+data.what=kill", "data.num_workers=2"), tmp_path)
    assert re.search(r"error: a loader worker of data\.train_dataset died: DataLoader worker \(pid \d+\) is killed "
                     r"by signal: Killed \(data\.num_workers=2; ", stderr), stderr


@pytest.mark.parametrize("hook", ["on_fit_start", "on_train_batch_end"])
def test_a_callback_that_raises_is_one_line_naming_the_callback_and_hook(tmp_path: Path, hook: str) -> None:
    stderr = _fails_in_one_line(tmp_path / "run", ("+callbacks.boom._target_=faulty_user_code.RaiseIn",
                                                   f"+callbacks.boom.hook={hook}"), tmp_path)
    assert f"error: callbacks.boom.{hook}() raised RuntimeError: injected failure in a callback\n" in stderr, stderr


@pytest.mark.slow
def test_a_sample_that_raises_under_ddp_names_the_rank_once(tmp_path: Path) -> None:
    stderr = _fails_in_one_line(tmp_path / "run", (*DDP2, *BAD_SAMPLE, "data.num_workers=2"), tmp_path)
    assert re.search(r"rank \d failed:\nreading a batch of data\.train_dataset raised ValueError", stderr), stderr


@pytest.mark.slow
def test_prepare_data_that_raises_under_ddp_is_said_once(tmp_path: Path) -> None:
    stderr = _fails_in_one_line(tmp_path / "run", (*DDP2, "data._target_=faulty_more.Hooks", "+data.what=raise"),
                                tmp_path)
    assert stderr.count("raised ValueError: injected failure in prepare_data") == 1, stderr
