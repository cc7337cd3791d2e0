"""Faults as users meet them: signals, restarts, hangs, non-finite losses, failed writes, colliding runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
TINY = ["data.num_samples=512", "data.val_samples=64", "data.batch_size=16", "trainer.log_every_n_steps=2"]
DDP2 = ["strategy=ddp", "accelerator=cpu", "trainer.devices=2"]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def start(run_dir: Path, *args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "runner", *args, f"hydra.run.dir={run_dir}"], cwd=cwd,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run(run_dir: Path, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args, f"hydra.run.dir={run_dir}"], cwd=cwd, env=env(),
                          capture_output=True, text=True, timeout=timeout)


def processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def step_of(checkpoint: Path) -> int:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["step"]


@pytest.mark.parametrize("target", ["parent", "worker"])
def test_sigterm_stops_at_a_step_saves_and_leaves_nothing_behind(tmp_path: Path, target: str) -> None:
    run_dir = tmp_path / "run"
    job = start(run_dir, *DDP2, *TINY, "model._target_=reliability_models.Slow", "trainer.max_steps=100000",
                "trainer.max_epochs=-1", cwd=tmp_path)
    assert wait_for(lambda: (run_dir / "rank_1.log").exists() and "global batch" in (run_dir / "rank_1.log").read_text(),
                    60), job.communicate(timeout=5)
    time.sleep(1.0)
    if target == "parent":
        victim = job.pid
    else:
        victim = next(pid for pid in processes_mentioning(str(run_dir)) if pid != job.pid)
    started = time.monotonic()
    os.kill(victim, signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    assert time.monotonic() - started < 40
    assert job.returncode != 0, stderr
    assert "Traceback" not in stderr
    assert step_of(run_dir / "checkpoints" / "last.ckpt") > 0
    assert wait_for(lambda: not processes_mentioning(str(run_dir)), 10)


def test_max_restarts_resumes_after_a_failure_and_finishes(tmp_path: Path) -> None:
    marker = tmp_path / "failed-once"
    result = run(tmp_path / "run", *DDP2, *TINY, "model._target_=reliability_models.FailOnce",
                 f"+model.marker={marker}", "+model.fail_at_step=7", "trainer.max_steps=12",
                 "trainer.ckpt_every_n_steps=4", "trainer.max_restarts=1", cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr
    assert marker.exists()
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["step"] == 12
    assert "resuming from" in (tmp_path / "run" / "runner.log").read_text()


def test_without_restarts_the_same_failure_ends_the_job_naming_the_rank(tmp_path: Path) -> None:
    result = run(tmp_path / "run", *DDP2, *TINY, "model._target_=reliability_models.FailOnce",
                 f"+model.marker={tmp_path / 'marker'}", "+model.fail_at_step=3", "trainer.max_steps=100000",
                 "trainer.max_epochs=-1", cwd=tmp_path, timeout=90)
    assert result.returncode != 0
    assert "rank 1" in result.stderr and "injected failure" in result.stderr


def test_a_stalled_rank_ends_the_job_after_the_strategy_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run(tmp_path / "run", *DDP2, *TINY, "model._target_=reliability_models.Slow", "+model.delay=0.0",
                 "+model.stall_rank=1", "+model.stall_at=3", "+model.stall=600", "strategy.timeout=5",
                 "trainer.max_steps=100000", "trainer.max_epochs=-1", cwd=tmp_path, timeout=120)
    assert time.monotonic() - started < 90
    assert result.returncode != 0
    assert "rank 0" in result.stderr and "waited longer than strategy.timeout" in result.stderr
    assert not processes_mentioning(str(tmp_path / "run"))


def test_nonfinite_loss_stops_with_the_step_and_the_last_good_checkpoint(tmp_path: Path) -> None:
    result = run(tmp_path / "run", *TINY, "model._target_=reliability_models.NaNAt", "+model.nan_at_step=7",
                 "trainer.ckpt_every_n_steps=4", "trainer.max_steps=20", cwd=tmp_path)
    assert result.returncode == 1
    assert "NaN or infinite" in result.stderr and "last.ckpt" in result.stderr and "Traceback" not in result.stderr
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["step"] == 4
    assert all(torch.isfinite(t).all() for t in checkpoint["model"].values())


def test_skip_nonfinite_loss_skips_the_step_and_finishes(tmp_path: Path) -> None:
    result = run(tmp_path / "run", *DDP2, *TINY, "model._target_=reliability_models.NaNAt", "+model.nan_at_step=3",
                 "trainer.skip_nonfinite_loss=true", "trainer.max_steps=8", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["train/skipped_steps"] == 1.0 and metrics["step"] == 8
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert all(torch.isfinite(t).all() for t in checkpoint["model"].values())


def test_a_failed_checkpoint_write_is_reported(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("a file where the checkpoint folder should be")
    result = run(run_dir, *TINY, "trainer.max_steps=3", cwd=tmp_path)
    assert result.returncode == 1
    assert "cannot write checkpoint" in result.stderr and "last.ckpt" in result.stderr
    assert "Traceback" not in result.stderr


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path: Path) -> None:
    jobs = [subprocess.Popen([sys.executable, "-m", "runner", *TINY, *DDP2, "trainer.max_steps=3"], cwd=tmp_path,
                             env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for job in jobs:
        _, stderr = job.communicate(timeout=120)
        assert job.returncode == 0, stderr
    folders = [p.parent for p in (tmp_path / "outputs").glob("*/*/metrics.json")]
    assert len(folders) == 2 and folders[0] != folders[1]


def test_slurm_sigusr1_checkpoints_requeues_and_the_requeued_job_resumes(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    scontrol.chmod(0o755)
    slurm = {**env(), "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "127.0.0.1",
             "SLURM_JOB_NAME": "train", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    args = [sys.executable, "-m", "runner", *TINY, "model._target_=reliability_models.Slow", "trainer.max_epochs=-1"]
    job = subprocess.Popen([*args, "trainer.max_steps=100000"], cwd=tmp_path, env=slurm, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "outputs" / "slurm-4242-0"
    assert wait_for(lambda: (run_dir / "runner.log").exists() and "global batch" in (run_dir / "runner.log").read_text(),
                    60), job.communicate(timeout=5)
    time.sleep(0.5)
    os.kill(job.pid, signal.SIGUSR1)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGUSR1, stderr
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    stopped_at = step_of(run_dir / "checkpoints" / "last.ckpt")
    assert stopped_at > 0
    # SLURM starts the same command again, with SLURM_RESTART_COUNT set: it continues in the same folder.
    again = subprocess.run([*args, f"trainer.max_steps={stopped_at + 4}"], cwd=tmp_path,
                           env={**slurm, "SLURM_RESTART_COUNT": "1"}, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == stopped_at + 4
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["slurm-4242-0"]


def test_workers_end_when_the_parent_is_killed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = start(run_dir, *DDP2, *TINY, "model._target_=reliability_models.Slow", "trainer.max_steps=100000",
                "trainer.max_epochs=-1", cwd=tmp_path)
    assert wait_for(lambda: (run_dir / "rank_1.log").exists() and "global batch" in (run_dir / "rank_1.log").read_text(),
                    60), job.communicate(timeout=5)
    assert len(processes_mentioning(str(run_dir))) >= 2
    os.kill(job.pid, signal.SIGKILL)  # no chance to clean up: the workers must notice by themselves
    job.communicate(timeout=10)
    assert wait_for(lambda: not processes_mentioning(str(run_dir)), 30)
    assert step_of(run_dir / "checkpoints" / "last.ckpt") > 0  # they still stopped at a step and saved
