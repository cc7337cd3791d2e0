"""The launcher: what workers find in their environment, a clean parent afterwards, and a failing rank ending the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest

from _dist import TESTS_DIR, clean_environ, processes_mentioning, run_cli
from runner.launch import _first_cause
from runner.processes import usable_cpus

# Run in a fresh interpreter (cwd: tests/, so workers import `faulty`): compose, snapshot os.environ, fit, compare.
FIT_SCRIPT = """
import json, os, sys
from hydra import compose, initialize_config_dir
import runner
from runner.cli import CONFIG_DIR
overrides, run_dir = json.loads(sys.argv[1]), sys.argv[2]
with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
    cfg = compose("config", overrides=overrides)
import torch
torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # torch itself sets TORCHINDUCTOR_CACHE_DIR here
before = dict(os.environ)
metrics = runner.fit(cfg, run_dir)
after = dict(os.environ)
changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
print(json.dumps({"changed": changed, "step": metrics["step"]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("omp, start_method, deterministic", [(None, "popen", False), ("3", "spawn", True),
                                                               (None, "fork", False)])
def test_worker_environment_and_parent_unchanged(tmp_path: Path, omp: Optional[str], start_method: str,
                                                 deterministic: bool) -> None:
    probes = tmp_path / "probes"
    probes.mkdir()
    overrides = ["strategy=ddp", "accelerator=cpu", "trainer.devices=2", f"strategy.start_method={start_method}",
                 "model=mlp", "model._target_=faulty.EnvProbe", f"+model.out_dir={probes}", "~model.hidden",
                 "~model.depth", "data.num_samples=64", "data.val_samples=20", "data.batch_size=16",
                 "trainer.max_steps=1", "trainer.max_epochs=-1", f"trainer.deterministic={deterministic}"]
    env = clean_environ() if omp is None else clean_environ(OMP_NUM_THREADS=omp)
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    result = subprocess.run([sys.executable, "-c", FIT_SCRIPT, json.dumps(overrides), str(tmp_path / "run")],
                            cwd=TESTS_DIR, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"changed": [], "step": 1}
    seen = [json.loads((probes / f"env_{rank}.json").read_text()) for rank in (0, 1)]
    expected_threads = omp or str(max(1, usable_cpus() // 2))
    for rank, worker in enumerate(seen):
        assert (worker["RANK"], worker["LOCAL_RANK"], worker["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert worker["MASTER_ADDR"] == "127.0.0.1"
        assert int(worker["MASTER_PORT"]) > 0
        assert worker["OMP_NUM_THREADS"] == expected_threads
        assert worker["torch_threads"] == int(expected_threads)  # a forked worker too, whatever its parent had
        # Deterministic CUDA matmuls need this set before the worker first touches cuBLAS.
        assert worker["CUBLAS_WORKSPACE_CONFIG"] == (":4096:8" if deterministic else None)
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"]


@pytest.mark.slow
@pytest.mark.parametrize("how, error", [("raise", "injected failure at step 3"), ("kill", "SIGKILL")])
def test_failing_rank_ends_the_job(tmp_path: Path, how: str, error: str) -> None:
    """Rank 1 fails at its third step of a run that would otherwise go on for hours."""
    run_dir = tmp_path / "run"
    args = ["strategy=ddp", "accelerator=cpu", "trainer.devices=2", "model._target_=faulty.FailOnRank1",
            f"+model.how={how}", "~model.hidden", "~model.depth", "data.num_samples=512", "data.val_samples=32",
            "data.batch_size=4", "trainer.max_epochs=100000", f"hydra.run.dir={run_dir}"]
    start = time.monotonic()
    result = run_cli(args, cwd=TESTS_DIR, timeout=90)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 60
    # The job's own last word names the rank and carries its error (not only the workers' echoed tracebacks).
    assert "error: rank 1" in result.stderr, result.stderr
    assert error in result.stderr[result.stderr.index("error: rank 1"):]
    deadline = time.monotonic() + 10  # a killed worker may take a moment to be reaped
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(run_dir)) == []
    assert not (run_dir / "metrics.json").exists()


def _failure(tmp_path: Path, rank: int, exitcode: int, trace: Optional[str] = None, timestamp: int = 0) -> object:
    """A ProcessFailure as the agent builds it: from the worker's error file, or stamped now when it left none."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"error_{rank}.json"
    if trace is not None:
        message = {"message": trace.splitlines()[-1], "extraInfo": {"py_callstack": trace, "timestamp": str(timestamp)}}
        error_file.write_text(json.dumps({"message": message}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


PEER_CLOSED = "Traceback...\nRuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:19373."


def test_a_killed_rank_is_the_cause_not_the_rank_that_lost_its_peer(tmp_path: Path) -> None:
    # The survivor's error file is stamped a second before the agent noticed the killed rank: still its consequence.
    failures = {0: _failure(tmp_path, 0, 1, PEER_CLOSED, timestamp=int(time.time()) - 1),
                1: _failure(tmp_path, 1, -9)}
    assert _first_cause(failures) == 1


def test_a_killed_rank_is_the_cause_not_the_rank_the_agent_then_stopped(tmp_path: Path) -> None:
    # Both stamped by the agent in the same second: the SIGTERM is the agent's own, sent after it saw the SIGKILL.
    failures = {0: _failure(tmp_path, 0, -signal.SIGTERM), 1: _failure(tmp_path, 1, -signal.SIGKILL)}
    assert _first_cause(failures) == 1
    failures[1] = _failure(tmp_path, 1, 1, PEER_CLOSED)
    failures[2] = _failure(tmp_path, 2, 1, "Traceback...\nRuntimeError: injected failure at step 3")
    assert _first_cause(failures) == 2


def test_a_raising_rank_is_the_cause_on_a_tie(tmp_path: Path) -> None:
    failures = {0: _failure(tmp_path, 0, 1, PEER_CLOSED, timestamp=100),
                1: _failure(tmp_path, 1, 1, "Traceback...\nRuntimeError: injected failure at step 3", timestamp=100)}
    assert _first_cause(failures) == 1


def test_of_two_real_failures_the_earlier_one_is_the_cause(tmp_path: Path) -> None:
    failures = {0: _failure(tmp_path, 0, 1, "Traceback...\nValueError: late", timestamp=101),
                1: _failure(tmp_path, 1, 1, "Traceback...\nValueError: early", timestamp=100)}
    assert _first_cause(failures) == 1
    failures[0] = _failure(tmp_path, 0, 1, "Traceback...\nValueError: as early", timestamp=100)
    assert _first_cause(failures) == 0  # a tie goes to the lower rank


def test_the_temporary_folders_of_killed_launchers_are_removed_at_the_next_launch(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.launch import SCRATCH_PREFIX, remove_stale_scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid is free now
    stale = tmp_path / f"{SCRATCH_PREFIX}{gone.pid}-abc"
    mine = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-def"
    (stale / "run" / "attempt_0" / "0").mkdir(parents=True)
    mine.mkdir()
    remove_stale_scratch()
    assert not stale.exists() and mine.exists()


def test_a_forkserver_worker_whose_launcher_is_gone_ends_without_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C while the forkserver forks a worker ends the launcher, which removes the semaphores the worker is
    unpickling: that FileNotFoundError, raised in multiprocessing's synchronize.py, is said by nobody (it printed 14
    lines after the launcher's line); any other error of a worker's start keeps its traceback."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the server's hook, not this process's
    from runner.forkserver import quiet_when_the_launcher_is_gone

    said: list[type] = []
    hook = quiet_when_the_launcher_is_gone(lambda kind, error, trace: said.append(kind))
    synchronize = "/usr/lib/python3/multiprocessing/synchronize.py"
    for source, where in (("raise FileNotFoundError(2, 'No such file or directory')", synchronize),
                          ("raise FileNotFoundError(2, 'No such file or directory')", "/home/me/my_data.py"),
                          ("raise ValueError('unpickling')", synchronize)):
        try:
            exec(compile(source, where, "exec"))
        except Exception:  # noqa: BLE001 - handed to the hook as the server hands it
            hook(*sys.exc_info())
    assert said == [FileNotFoundError, ValueError]
