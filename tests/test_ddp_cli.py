"""`python -m runner strategy=ddp` on CPU: the run folder of a 2-process job, under the runner's launcher and torchrun,
and the equivalence of 2 processes x batch B with 1 process x 2B."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _dist import assert_ok, assert_one_run_folder, clean_environ, run_cli, torchrun
from conftest import read_events

pytestmark = pytest.mark.slow  # each test starts 2 processes from a fresh interpreter

TWO_CPU = ["strategy=ddp", "accelerator=cpu", "trainer.devices=2", "data=synthetic", "model=mlp"]
SHORT = ["data.num_samples=128", "data.val_samples=40", "data.batch_size=16", "trainer.max_steps=3",
         "trainer.max_epochs=-1", "model.hidden=16"]


# In the launcher (`python -m runner`) alone: an exit handler, and an object whose __del__ only the interpreter's
# teardown of the modules calls; each leaves a file when it runs.
WITNESSES = """
import atexit, os, sys
if sys.orig_argv[1:3] == ["-m", "runner"]:
    _here = os.path.dirname(os.path.abspath(__file__))
    atexit.register(lambda: open(os.path.join(_here, "exit-handler-ran"), "w").close())

    class _TornDown:
        def __del__(self, open=open, join=os.path.join):
            open(join(_here, "torn-down"), "w").close()

    _witness = _TornDown()
"""


@pytest.mark.parametrize("start_method", ["popen", "spawn", "fork", "forkserver"])
def test_two_processes_one_run_folder(tmp_path: Path, start_method: str) -> None:
    run_dir, site = tmp_path / "run", tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(WITNESSES)
    result = run_cli([*TWO_CPU, *SHORT, f"strategy.start_method={start_method}", f"hydra.run.dir={run_dir}"],
                     cwd=tmp_path, env=clean_environ(PYTHONPATH=str(site)))
    assert_ok(result)
    assert_one_run_folder(run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["step"] == 3 and "val/loss" in metrics
    assert "global batch 32" in (run_dir / "runner.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "site"]  # nothing written beside the run folder
    # The workers trained the job: the launcher ends through its exit handlers, without the teardown of the modules.
    assert sorted(p.name for p in site.iterdir() if p.suffix != ".py") == ["exit-handler-ran"]
    assert "done: " in result.stderr  # the console's last lines came through


def test_torchrun_with_run_dir(tmp_path: Path) -> None:
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    result = torchrun([*TWO_CPU, *SHORT, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=clean_environ(TMPDIR=str(tmp)))
    assert_ok(result)
    assert_one_run_folder(run_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "tmp"]
    assert not list(tmp.glob("runner-*")), "a finished torchrun job leaves no temporary folder of the runner's"
    assert "starting 2 worker processes" not in result.stderr + result.stdout  # torchrun made them


def test_torchrun_default_run_dir_is_created_once_and_devices_auto_takes_its_processes(tmp_path: Path) -> None:
    result = torchrun([o for o in TWO_CPU if o != "trainer.devices=2"] + SHORT, cwd=tmp_path)
    assert_ok(result)
    runs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(runs) == 1, runs  # rank 1 composes the same config but must not create a folder of its own
    assert_one_run_folder(runs[0])
    assert "x 2 process(es)" in (runs[0] / "runner.log").read_text()  # devices=auto: the 2 torchrun started


def test_torchrun_world_size_mismatch_fails_before_training(tmp_path: Path) -> None:
    result = torchrun([*TWO_CPU, *SHORT, "trainer.devices=3", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode != 0
    assert "trainer.devices=3" in result.stderr and "torchrun started 2" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def _final_state(run_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    return checkpoint["model"], json.loads((run_dir / "metrics.json").read_text())


def test_two_processes_equal_one_process_with_twice_the_batch(tmp_path: Path) -> None:
    # 256 samples / global batch 32 = 8 steps per epoch: 12 steps cross an epoch boundary (a reshuffle).
    common = ["accelerator=cpu", "data=synthetic", "model=mlp", "optimizer=sgd", "trainer.max_steps=12",
              "trainer.max_epochs=-1", "data.num_samples=256", "data.val_samples=333", "trainer.seed=7",
              "trainer.log_every_n_steps=1"]
    assert_ok(run_cli([*common, "strategy=ddp", "trainer.devices=2", "data.batch_size=16",
                       f"hydra.run.dir={tmp_path / 'two'}"], cwd=tmp_path))
    assert_ok(run_cli([*common, "strategy=single", "trainer.devices=1", "data.batch_size=32",
                       f"hydra.run.dir={tmp_path / 'one'}"], cwd=tmp_path))
    weights_two, metrics_two = _final_state(tmp_path / "two")
    weights_one, metrics_one = _final_state(tmp_path / "one")
    assert metrics_two["step"] == metrics_one["step"] == 12
    assert weights_two.keys() == weights_one.keys()
    for name, tensor in weights_one.items():
        torch.testing.assert_close(weights_two[name], tensor, atol=1e-4, rtol=0, msg=name)
    # 333 validation samples do not split evenly over 2 processes; each must still count exactly once.
    assert metrics_two["val/loss"] == pytest.approx(metrics_one["val/loss"], abs=1e-5)
    assert metrics_two["val/acc"] == pytest.approx(metrics_one["val/acc"], abs=1e-9)
    # Every step logged: each step's sums are reduced over the 2 processes while the next step trains.
    for tag in ("train/loss", "train/acc"):
        two = [(event.step, event.value) for event in read_events(tmp_path / "two").Scalars(tag)]
        one = [(event.step, event.value) for event in read_events(tmp_path / "one").Scalars(tag)]
        assert [step for step, _ in two] == [step for step, _ in one] == list(range(1, 13)), tag
        assert [value for _, value in two] == pytest.approx([value for _, value in one], abs=1e-5), tag


def test_torchrun_leaves_no_temporary_folder_even_when_killed(tmp_path: Path) -> None:
    """Ranks > 0 make no folder of their own, so not even SIGKILL can leave one behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = clean_environ(TMPDIR=str(tmp))
    run_dir = tmp_path / "killed"
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            "-m", "runner", *TWO_CPU, *SHORT, "trainer.max_steps=100000", f"hydra.run.dir={run_dir}"],
                           cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (run_dir / "rank_1.log").exists() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.2)
        assert (run_dir / "rank_1.log").exists(), "the job never started training"
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # torchrun alone: its ranks lead sessions of their own
        job.wait(timeout=30)
    assert not list(tmp.glob("runner-rank-*"))

    def ranks() -> list[str]:
        return [pid for pid in filter(str.isdigit, os.listdir("/proc")) if str(run_dir).encode() in _cmdline(pid)]

    deadline = time.monotonic() + 60
    while ranks() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ranks(), "torchrun's ranks outlived it"
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["step"] > 0  # they stopped at a step


@pytest.mark.parametrize("sweep", [["-m", "optimizer.lr=0.1,0.01"], ["experiment=lr_sweep"]], ids=["-m", "preset"])
def test_torchrun_refuses_a_sweep_with_a_message(tmp_path: Path, sweep: list[str]) -> None:
    result = torchrun([*TWO_CPU, *SHORT, *sweep, f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    assert "a sweep (-m) cannot run in processes torchrun started" in result.stderr
    assert not list(tmp_path.glob("sweep/*/metrics.json")) and not (tmp_path / "outputs").exists()


def test_workers_apply_the_jobs_hydra_job_logging(tmp_path: Path) -> None:
    custom = tmp_path / "custom"
    assert_ok(run_cli([*TWO_CPU, *SHORT, f"hydra.run.dir={custom}",
                       "hydra.job_logging.formatters.simple.format='CUSTOM %(levelname)s %(message)s'"], cwd=tmp_path))
    for log in ("runner.log", "rank_1.log"):  # rank 0's worker and rank 1 both format as the job says
        lines = (custom / log).read_text().splitlines()
        assert lines and all(line.startswith("CUSTOM ") for line in lines), (log, lines[:3])
    assert any("config hash" in line for line in (custom / "rank_1.log").read_text().splitlines())
    disabled = tmp_path / "disabled"
    assert_ok(run_cli([*TWO_CPU, *SHORT, f"hydra.run.dir={disabled}", "hydra/job_logging=disabled"], cwd=tmp_path))
    assert (disabled / "metrics.json").exists() and not list(disabled.glob("*.log"))


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
