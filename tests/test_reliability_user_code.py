"""User code that fails mid-run (a sample, a loader worker, a callback, a data hook under DDP) ends the run in one
line naming what failed, exit 1, its traceback in the run's log file; a stop signal during stage=predict stops at a
batch and writes no partial predictions. Real processes, real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from test_reliability import DDP2, TINY, start, wait_for

BAD_SAMPLE = ("data._target_=faulty_user_code.BadSample",)


def _fails_in_one_line(run_dir: Path, args: tuple, cwd: Path) -> str:
    job = start(run_dir, *args, *TINY, cwd=cwd)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 1, stderr
    assert "Traceback" not in stderr and "Error executing job" not in stderr, stderr
    assert not (run_dir / "metrics.json").exists()
    # For the code's author, in the log of the rank that failed (rank 0's is runner.log).
    rank = re.search(r"^error: rank (\d+): ", stderr, re.MULTILINE)
    log = f"rank_{rank.group(1)}.log" if rank and rank.group(1) != "0" else "runner.log"
    assert "Traceback" in (run_dir / log).read_text(), log
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
    # torch raises it from its SIGCHLD handler wherever the process is, or the batch's read finds it.
    assert re.search(r"error: a loader worker of (data\.train_dataset|the data) died: DataLoader worker \(pid \d+\) "
                     r"is killed by signal: (Killed|SIGKILL) \(data\.num_workers=2; ", stderr), stderr


@pytest.mark.slow
def test_a_loader_worker_killed_under_ddp_is_the_same_one_line(tmp_path: Path) -> None:
    stderr = _fails_in_one_line(tmp_path / "run", (*DDP2, *BAD_SAMPLE, "+data.what=kill", "data.num_workers=2"),
                                tmp_path)
    errors = [line for line in stderr.splitlines() if line and not line.startswith("[")]
    assert re.fullmatch(r"error: rank \d: a loader worker of (data\.train_dataset|the data) died: DataLoader worker "
                        r"\(pid \d+\) is killed by signal: (Killed|SIGKILL) \(data\.num_workers=2; .*", errors[0]), stderr
    assert errors[1:] in ([], ["then rank 0: the same"], ["then rank 1: the same"]), stderr


@pytest.mark.parametrize("hook", ["on_fit_start", "on_train_batch_end"])
def test_a_callback_that_raises_is_one_line_naming_the_callback_and_hook(tmp_path: Path, hook: str) -> None:
    stderr = _fails_in_one_line(tmp_path / "run", ("+callbacks.boom._target_=faulty_user_code.RaiseIn",
                                                   f"+callbacks.boom.hook={hook}"), tmp_path)
    assert f"error: callbacks.boom.{hook}() raised RuntimeError: injected failure in a callback\n" in stderr, stderr


@pytest.mark.slow
def test_a_sample_that_raises_under_ddp_names_the_rank_once(tmp_path: Path) -> None:
    stderr = _fails_in_one_line(tmp_path / "run", (*DDP2, *BAD_SAMPLE, "data.num_workers=2"), tmp_path)
    assert re.search(r"rank \d: reading a batch of data\.train_dataset raised ValueError", stderr), stderr


@pytest.mark.slow
def test_prepare_data_that_raises_under_ddp_is_said_once(tmp_path: Path) -> None:
    stderr = _fails_in_one_line(tmp_path / "run", (*DDP2, "data._target_=faulty_more.Hooks", "+data.what=raise"),
                                tmp_path)
    assert stderr.count("raised ValueError: injected failure in prepare_data") == 1, stderr


SLOW_EVAL = ("model._target_=faulty_more.SlowEval", "+model.delay=0.5", "data.val_samples=16")


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint both predict runs take (trained once per test process: the module's tests may interleave with
    others')."""
    folder = tmp_path_factory.mktemp("trained")
    assert start(folder / "run", *TINY, *SLOW_EVAL, "trainer.max_steps=2", cwd=folder).wait(timeout=120) == 0
    return folder / "run" / "checkpoints" / "last.ckpt"


@pytest.mark.slow
@pytest.mark.xdist_group("predict_sigterm")
@pytest.mark.parametrize("processes", [(), DDP2], ids=["1-process", "ddp-2"])
def test_sigterm_during_predict_stops_at_a_batch_and_writes_no_partial_predictions(tmp_path: Path, trained: Path,
                                                                                   processes: tuple) -> None:
    """predict ran on to its last batch and wrote predictions.pt as if complete (0.5 s a batch: an 8 s pass)."""
    run_dir = tmp_path / "predict"
    job = start(run_dir, *processes, *TINY, *SLOW_EVAL, "data.test_samples=256", "stage=predict",
                f"trainer.ckpt_path={trained}", cwd=tmp_path)
    log = run_dir / "runner.log"
    assert wait_for(lambda: log.exists() and "stage=predict with the weights" in log.read_text(), 90)
    time.sleep(1)
    os.kill(job.pid, signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGTERM, stderr  # a pass run to its end would write predictions.pt
    assert "stopped by SIGTERM during stage=predict before its end: it wrote no predictions.pt; run it again" in stderr
    assert not (run_dir / "predictions.pt").exists()
    assert json.loads((run_dir / "metrics.json").read_text())["stopped_in"] == "stage=predict"
    assert "Traceback" not in stderr
