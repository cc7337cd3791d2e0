"""Faults as users meet them: signals, restarts, hangs, non-finite losses, failed writes, colliding runs."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
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


def start(run_dir: Path, *args: str, cwd: Path, new_session: bool = False) -> subprocess.Popen:
    # The variable marks every process of the job, spawned workers too, whose command lines name no folder.
    return subprocess.Popen([sys.executable, "-m", "runner", *args, f"hydra.run.dir={run_dir}"], cwd=cwd,
                            env={**env(), "RELIABILITY_TEST_RUN": str(run_dir)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=new_session)


def run(run_dir: Path, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args, f"hydra.run.dir={run_dir}"], cwd=cwd, env=env(),
                          capture_output=True, text=True, timeout=timeout)


def processes_mentioning(text: str) -> list[int]:
    """Processes whose command line or environment holds `text` (a run folder: see `start`)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            seen = b" ".join(Path(f"/proc/{pid}/{part}").read_bytes() for part in ("cmdline", "environ"))
        except OSError:
            continue
        if text in seen.replace(b"\0", b" ").decode(errors="replace") and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def worker_pids(run_dir: Path, launcher: int) -> list[int]:
    """The job's worker processes (no loader workers here): those of its processes that are no other's parent, less
    the launcher and multiprocessing's resource tracker (under strategy.start_method=forkserver the workers are the
    children of a server that shares their command line)."""
    found = [pid for pid in processes_mentioning(str(run_dir)) if pid != launcher]
    parents = {_parent(pid) for pid in found}
    return [pid for pid in found if pid not in parents and b"resource_tracker import" not in _command(pid)]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError):
        return -1


def _command(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def step_of(checkpoint: Path) -> int:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["step"]


def training(run_dir: Path) -> bool:
    log = run_dir / "rank_1.log"
    return log.exists() and "global batch" in log.read_text()


def assert_stopped_and_saved(run_dir: Path, stderr: str, name: str) -> None:
    """The message names the signal and a step; last.ckpt holds that step with finite weights; no process is left."""
    said = re.search(rf"stopped by {name} at step (\d+), saved in (\S+); resume with trainer.ckpt_path=", stderr)
    assert said, stderr
    assert Path(said[2]) == run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(said[2], map_location="cpu", weights_only=True)
    assert checkpoint["step"] == int(said[1]) > 0
    assert all(torch.isfinite(t).all() for t in checkpoint["model"].values())
    assert "Traceback" not in stderr
    assert wait_for(lambda: not processes_mentioning(str(run_dir)), 10)


# 0.5 s steps and a log step every 1000: a stop must come at the next step, not the next log step.
SLOW = ("model._target_=reliability_models.Slow", "+model.delay=0.5", "trainer.log_every_n_steps=1000",
        "trainer.max_steps=100000", "trainer.max_epochs=-1")


@pytest.mark.parametrize("target", ["parent", "worker"])
def test_sigterm_stops_at_the_next_step_saves_and_names_it(tmp_path: Path, target: str) -> None:
    run_dir = tmp_path / "run"
    job = start(run_dir, *DDP2, *TINY, *SLOW, cwd=tmp_path)
    assert wait_for(lambda: training(run_dir), 60), job.communicate(timeout=5)
    time.sleep(1.0)
    if target == "parent":
        victim = job.pid
    else:  # one worker alone: the other learns it at the next step, and the job still exits 128 + SIGTERM
        victim = worker_pids(run_dir, job.pid)[0]
    started = time.monotonic()
    os.kill(victim, signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    assert time.monotonic() - started < 15  # two 0.5 s steps and a save, far inside the launcher's 30 s grace
    assert job.returncode == 128 + signal.SIGTERM, stderr
    assert_stopped_and_saved(run_dir, stderr, "SIGTERM")


@pytest.mark.parametrize("start_method, signum", [("spawn", signal.SIGINT), ("fork", signal.SIGINT),
                                                  ("popen", signal.SIGHUP)])
def test_a_terminal_signal_to_the_whole_group_stops_once_with_a_checkpoint(tmp_path: Path, start_method: str,
                                                                          signum: int) -> None:
    """Ctrl-C, or a closed terminal, signals every process of the foreground group at once."""
    run_dir = tmp_path / "run"
    job = start(run_dir, *DDP2, *TINY, *SLOW, f"strategy.start_method={start_method}", cwd=tmp_path,
                new_session=True)
    assert wait_for(lambda: training(run_dir), 60), job.communicate(timeout=5)
    time.sleep(1.0)
    started = time.monotonic()
    os.killpg(job.pid, signum)
    _, stderr = job.communicate(timeout=60)
    # Workers that have saved end at once, not at the launcher's SIGKILL 30 s later (spawn/fork wait for it).
    assert time.monotonic() - started < 15
    assert job.returncode == 128 + signum, stderr
    assert_stopped_and_saved(run_dir, stderr, signal.Signals(signum).name)


@pytest.mark.parametrize("strategy", [("strategy=single",), DDP2], ids=["single", "ddp"])
def test_one_ctrl_c_that_arrives_twice_within_milliseconds_is_one_stop_request(tmp_path: Path, strategy: tuple) -> None:
    """Under `timeout`, a shell script or srun, a Ctrl-C reaches the job twice within milliseconds (from the
    terminal, then passed on by the wrapper): still one request, so the job saves and stops, rather than taking it
    for "Ctrl-C twice: stop now, save nothing"."""
    run_dir = tmp_path / "run"
    job = start(run_dir, *strategy, *TINY, *SLOW, cwd=tmp_path, new_session=True)
    log = run_dir / "runner.log"
    assert wait_for(lambda: log.exists() and "global batch" in log.read_text(), 60), job.communicate(timeout=5)
    time.sleep(1)
    os.killpg(job.pid, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(job.pid, signal.SIGINT)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGINT, stderr
    assert_stopped_and_saved(run_dir, stderr, "SIGINT")


def test_a_stop_signal_ends_the_whole_sweep(tmp_path: Path) -> None:
    """Not only the job it came in: the sweep's next jobs do not start, and the sweep exits 128+signal."""
    sweep_dir = tmp_path / "sweep"
    job = subprocess.Popen([sys.executable, "-m", "runner", "-m", "optimizer.lr=0.1,0.01", *TINY, *SLOW,
                            f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = sweep_dir / "0" / "runner.log"
    assert wait_for(lambda: log.exists() and "global batch" in log.read_text(), 60), job.communicate(timeout=5)
    time.sleep(1)
    os.kill(job.pid, signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM at step" in stderr and "the sweep stopped at job 0" in stderr, stderr
    assert not (sweep_dir / "1").exists(), "the sweep's next job started"
    assert json.loads((sweep_dir / "0" / ".hydra" / "job_status.json").read_text())["status"] == "stopped"


def test_ctrl_c_while_the_workers_start_ends_the_job_at_once_and_quietly(tmp_path: Path) -> None:
    """The workers take seconds to import torch: a Ctrl-C then ends them with no KeyboardInterrupt traceback.

    With the default popen workers, which lead a session of their own from the start. (spawn: README.)
    """
    run_dir = tmp_path / "run"
    job = start(run_dir, *DDP2, *TINY, *SLOW, "strategy.start_method=popen", cwd=tmp_path, new_session=True)
    deadline = time.monotonic() + 60
    while len(processes_mentioning(str(run_dir))) < 3 and time.monotonic() < deadline:  # the launcher, 2 more
        time.sleep(0.01)
    os.killpg(job.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground process group
    started = time.monotonic()
    stdout, stderr = job.communicate(timeout=60)
    assert time.monotonic() - started < 10, stderr
    assert job.returncode == 128 + signal.SIGINT, stderr
    assert "stopped by SIGINT before the first checkpoint" in stderr
    assert "Traceback" not in stdout + stderr and "KeyboardInterrupt" not in stdout + stderr, stderr
    assert wait_for(lambda: not processes_mentioning(str(run_dir)), 10)


@pytest.mark.parametrize("start_method", ["spawn", "popen"])
def test_ctrl_c_twice_under_the_launcher_stops_now(tmp_path: Path, start_method: str) -> None:
    """The second Ctrl-C does not wait for the step (3 s here) and its checkpoint: the workers end at once."""
    run_dir = tmp_path / "run"
    slower = [arg.replace("delay=0.5", "delay=3") for arg in SLOW]
    job = start(run_dir, *DDP2, *TINY, *slower, f"strategy.start_method={start_method}", cwd=tmp_path,
                new_session=True)
    assert wait_for(lambda: training(run_dir), 60), job.communicate(timeout=5)
    os.killpg(job.pid, signal.SIGINT)
    time.sleep(0.5)  # a second press, not the same one passed on again (runner.entry.SAME_REQUEST_S)
    started = time.monotonic()
    os.killpg(job.pid, signal.SIGINT)
    _, stderr = job.communicate(timeout=60)
    assert time.monotonic() - started < 5, stderr
    assert job.returncode == 128 + signal.SIGINT, stderr
    assert "stopped by SIGINT before the first checkpoint: nothing was saved" in stderr
    assert "Traceback" not in stderr and "death signal" not in stderr  # no log line of torchelastic's agent
    assert wait_for(lambda: not processes_mentioning(str(run_dir)), 10)
    assert not (run_dir / "checkpoints" / "last.ckpt").exists(), "no worker may go on to save after the job ended"


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
    # Rank 1 stalls 8 s outside any collective; rank 0, waiting for it, must give up after 2 s and name itself.
    # (A longer stall ends the same way, 30 s later: the launcher's grace for a rank that ignores SIGTERM.)
    started = time.monotonic()
    result = run(tmp_path / "run", *DDP2, *TINY, "model._target_=reliability_models.Slow", "+model.delay=0.0",
                 "+model.stall_rank=1", "+model.stall_at=3", "+model.stall=8", "strategy.timeout=2",
                 "trainer.max_steps=100000", "trainer.max_epochs=-1", cwd=tmp_path, timeout=120)
    assert time.monotonic() - started < 60
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


def test_a_checkpoint_folder_that_cannot_be_written_is_reported_before_training(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("a file where the checkpoint folder should be")
    result = run(run_dir, *TINY, "trainer.max_steps=3", cwd=tmp_path)
    assert result.returncode == 1
    assert f"cannot write in {run_dir / 'checkpoints'}: {run_dir / 'checkpoints'} is a file" in result.stderr
    assert "Traceback" not in result.stderr
    assert "global batch" not in (run_dir / "runner.log").read_text() and not (run_dir / "tensorboard").exists()


def test_nan_gradients_with_a_finite_loss_are_never_saved(tmp_path: Path) -> None:
    # Step 4's loss is finite, its gradients NaN: the weights it leaves are NaN, and step 4 is a checkpoint step.
    result = run(tmp_path / "run", *TINY, "model._target_=reliability_models.NaNGradientAt", "+model.nan_at_step=4",
                 "trainer.ckpt_every_n_steps=2", "trainer.log_every_n_steps=100", "trainer.max_steps=20", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert f"the weights became NaN or infinite by step 4; they are not saved, and the last good checkpoint is {last}" \
        in result.stderr
    checkpoint = torch.load(last, map_location="cpu", weights_only=True)
    assert checkpoint["step"] == 2 and all(torch.isfinite(t).all() for t in checkpoint["model"].values())
    assert not (tmp_path / "run" / "checkpoints" / "step-000004.ckpt").exists()


def test_skip_nonfinite_loss_also_skips_nan_gradients_and_ends_finite(tmp_path: Path) -> None:
    result = run(tmp_path / "run", *TINY, "model._target_=reliability_models.NaNGradientAt", "+model.nan_at_step=3",
                 "trainer.skip_nonfinite_loss=true", "trainer.max_steps=8", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["train/skipped_steps"] == 1.0 and metrics["step"] == 8
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert all(torch.isfinite(t).all() for t in checkpoint["model"].values())


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path: Path) -> None:
    # The launching process picks the folder (a DDP job's workers get it from there): one process each is enough.
    jobs = [subprocess.Popen([sys.executable, "-m", "runner", *TINY, "trainer.max_steps=3"], cwd=tmp_path,
                             env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for job in jobs:
        _, stderr = job.communicate(timeout=120)
        assert job.returncode == 0, stderr
    folders = [p.parent for p in (tmp_path / "outputs").glob("*/*/metrics.json")]
    assert len(folders) == 2 and folders[0] != folders[1]


def test_a_sweep_whose_second_is_taken_gets_a_folder_of_its_own(tmp_path: Path) -> None:
    """Two sweeps started in one second: the second finds the first's folder and must not write into it."""
    now = time.time()
    taken = [tmp_path / "multirun" / time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(now + k)) for k in range(60)]
    for folder in taken:  # every folder a sweep started in the next minute would pick
        folder.mkdir(parents=True)
        (folder / "other-sweep").write_text("")
    result = subprocess.run([sys.executable, "-m", "runner", "-m", "optimizer.lr=0.1,0.01", *TINY,
                             "trainer.max_steps=2", "logger=none"], cwd=tmp_path, env=env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert all(sorted(p.name for p in folder.iterdir()) == ["other-sweep"] for folder in taken)
    mine = [p for p in (tmp_path / "multirun").glob("*/*") if p not in taken]
    assert len(mine) == 1 and mine[0].name.rsplit("-", 1)[0] in {f.name for f in taken}
    assert sorted(p.parent.name for p in mine[0].glob("*/metrics.json")) == ["0", "1"]


def test_half_written_files_of_a_killed_process_are_removed_at_the_next_start(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert run(run_dir, *TINY, "trainer.max_steps=2", cwd=tmp_path).returncode == 0
    gone = subprocess.Popen(["true"])  # its pid is free once it is waited for
    gone.wait()
    left = [run_dir / "checkpoints" / f".last.ckpt.tmp-{gone.pid}-0a1b2c3d", run_dir / f".metrics.json.tmp-{gone.pid}",
            run_dir / f"metrics.csv.tmp-{gone.pid}"]
    for path in left:  # what SIGKILL during a save leaves: no rename ever came
        path.write_bytes(b"half a file")
    mine = run_dir / "checkpoints" / f".last.ckpt.tmp-{os.getpid()}-0a1b2c3d"  # a live process's write: kept
    mine.write_bytes(b"in progress")
    result = run(run_dir, *TINY, "trainer.max_steps=4", "trainer.ckpt_path=last", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not any(path.exists() for path in left) and mine.exists()
    assert "removed 3 half-written file(s)" in (run_dir / "runner.log").read_text()
    assert step_of(run_dir / "checkpoints" / "last.ckpt") == 4


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


@pytest.mark.parametrize("start_method", ["popen", "spawn", "forkserver"])
def test_workers_end_when_the_parent_is_killed(tmp_path: Path, start_method: str) -> None:
    run_dir = tmp_path / "run"
    job = start(run_dir, *DDP2, *TINY, "model._target_=reliability_models.Slow", "trainer.max_steps=100000",
                "trainer.max_epochs=-1", f"strategy.start_method={start_method}", cwd=tmp_path)
    assert wait_for(lambda: (run_dir / "rank_1.log").exists() and "global batch" in (run_dir / "rank_1.log").read_text(),
                    60), job.communicate(timeout=5)
    assert len(processes_mentioning(str(run_dir))) >= 2
    os.kill(job.pid, signal.SIGKILL)  # no chance to clean up: the workers must notice by themselves
    job.communicate(timeout=10)
    assert wait_for(lambda: not processes_mentioning(str(run_dir)), 30)  # spawned ones too: none waits for it
    assert step_of(run_dir / "checkpoints" / "last.ckpt") > 0  # they still stopped at a step and saved


# A program of the user's with a child process of its own, fitting with DDP through runner.fit.
PROGRAM_WITH_A_CHILD = """
import subprocess, sys
import runner
helper = subprocess.Popen(["sleep", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(helper.pid, flush=True)
try:
    runner.fit(runner.compose(sys.argv[2:]), run_dir=sys.argv[1])
except Exception as error:
    print(type(error).__name__, error, file=sys.stderr)
    sys.exit(3)
"""


def test_a_stop_signal_goes_to_the_workers_not_to_other_children_of_the_program(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-c", PROGRAM_WITH_A_CHILD, str(run_dir), *DDP2, *TINY, *SLOW],
                           cwd=tmp_path, env={**env(), "RELIABILITY_TEST_RUN": str(run_dir)}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    helper = int(job.stdout.readline())
    try:
        assert wait_for(lambda: training(run_dir), 60), job.communicate(timeout=5)
        os.kill(job.pid, signal.SIGTERM)
        _, stderr = job.communicate(timeout=60)
        assert job.returncode == 3 and "JobStopped stopped by SIGTERM at step" in stderr, stderr
        assert Path(f"/proc/{helper}").exists(), "the program's own child got the signal too"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(helper, signal.SIGKILL)


def test_a_signal_in_the_final_validation_ends_a_complete_job_with_exit_0(tmp_path: Path) -> None:
    """SIGTERM to the launcher while the workers ran the final validation (every step taken): the launcher reported
    the job as stopped (exit 143, `resume with ...`) though its workers said there was nothing to resume, and their
    line said that the validation had run though the signal cut it."""
    run_dir, marker = tmp_path / "run", tmp_path / "validating"
    job = start(run_dir, *DDP2, *TINY, "model._target_=reliability_models.SlowFinalValidation",
                f"+model.marker={marker}", "+model.steps=2", "trainer.max_steps=2", cwd=tmp_path)
    assert wait_for(marker.exists, 90), job.communicate(timeout=5)
    os.kill(job.pid, signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 0, stderr
    assert ("SIGTERM came after the last step (2): the run is complete, nothing to resume; the final validation was "
            "skipped") in (run_dir / "runner.log").read_text()
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["validation_due"] is True
