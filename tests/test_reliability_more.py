"""Faults around the edges of training: a signal during an evaluation, user hooks that exit or hang, a log file
planted as a link, a stall before the first step, a restarted job. Real signals, real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_reliability import DDP2, TINY, env, processes_mentioning, start, wait_for, worker_pids

# 1 s per evaluation batch; 512 test samples in batches of 16: a 16 s test on each of 2 processes.
SLOW_TEST = ("model._target_=faulty_more.SlowEval", "+model.delay=1.0", "data.val_samples=16",
             "data.test_samples=512", "trainer.max_steps=4")


def _testing(run_dir: Path) -> bool:
    log = run_dir / "runner.log"
    return log.exists() and "testing " in log.read_text()


@pytest.mark.parametrize("target", ["parent", "worker"])
def test_sigterm_during_the_test_after_training_stops_it_at_the_next_batch(tmp_path: Path, target: str) -> None:
    run_dir = tmp_path / "run"
    job = start(run_dir, *DDP2, *TINY, *SLOW_TEST, cwd=tmp_path)
    assert wait_for(lambda: _testing(run_dir), 90), job.communicate(timeout=5)
    time.sleep(1.5)
    victim = job.pid if target == "parent" else max(worker_pids(run_dir, job.pid))
    started = time.monotonic()
    os.kill(victim, signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    assert time.monotonic() - started < 8, stderr  # a batch or two, not the rest of a 16 s test
    assert job.returncode == 128 + signal.SIGTERM, stderr
    last = run_dir / "checkpoints" / "last.ckpt"
    assert (f"stopped by SIGTERM during the test after training (training ended at step 4, saved in {last}); no "
            f"test metrics: test with stage=test trainer.ckpt_path={last}") in stderr, stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["stop_signal"] == signal.SIGTERM and not any(key.startswith("test/") for key in metrics)
    assert "Traceback" not in stderr
    assert wait_for(lambda: not processes_mentioning(str(run_dir)), 10)


def test_a_link_planted_as_a_rank_log_is_refused_not_written_through(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("precious\n")
    (run_dir / "rank_1.log").symlink_to(target)
    job = start(run_dir, *DDP2, *TINY, "trainer.max_steps=2", cwd=tmp_path)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 1, stderr
    assert (f"{run_dir / 'rank_1.log'} is a symbolic link (to {target}); the runner never writes a log through a "
            "link: remove it, or choose another hydra.run.dir") in stderr, stderr
    assert target.read_text() == "precious\n"
    assert "Traceback" not in stderr


@pytest.mark.parametrize(("hook", "what", "processes", "line"), [
    ("prepare_data", "exit", DDP2, "data.prepare_data() exited (SystemExit(0)) on local rank 0 of a node"),
    ("setup", "raise", (), "data.setup('fit') raised ValueError: injected failure in setup"),
], ids=["prepare_data-exits-ddp", "setup-raises"])
def test_a_data_hook_that_exits_or_raises_fails_the_run_in_one_line(tmp_path: Path, hook: str, what: str,
                                                                     processes: tuple, line: str) -> None:
    """A library helper's sys.exit(0) in prepare_data ended the run with exit 0, nothing trained; a raise printed
    the hook's traceback on the console (twice under DDP)."""
    run_dir = tmp_path / "run"
    job = start(run_dir, *processes, *TINY, "data._target_=faulty_more.Hooks", f"+data.hook={hook}",
                f"+data.what={what}", cwd=tmp_path)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 1 and line in stderr, stderr
    assert "Traceback" not in stderr and not (run_dir / "metrics.json").exists()
    assert "Traceback" in (run_dir / "runner.log").read_text()  # the hook's own, for its author


def test_a_restarted_job_says_it_resumes_not_that_it_starts_from_scratch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = start(run_dir, *TINY, "trainer.max_steps=2", cwd=tmp_path)
    assert first.wait(timeout=120) == 0
    again = subprocess.run([sys.executable, "-m", "runner", *TINY, "trainer.max_steps=4", f"hydra.run.dir={run_dir}"],
                           cwd=tmp_path, env={**env(), "TORCHELASTIC_RESTART_COUNT": "1"}, capture_output=True,
                           text=True, timeout=120)
    said = again.stdout + again.stderr
    assert again.returncode == 0, said
    assert "starts from scratch" not in said
    assert "restart 1 of this job (torchelastic after a failure, or a SLURM requeue); resuming from the job's " \
           "last.ckpt" in said
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == 4
