"""Cluster environments: detection from torchrun/SLURM variables, SLURM addresses and ports, settings checks, srun runs."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import LAUNCH_VARIABLES, assert_one_run_folder, clean_environ, port_is_free
from runner.environments import (
    LocalEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    detect_environment,
)
from runner.environments.environment import first_hostname

TORCHRUN_VARS = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.7",
                 "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "abc", "GROUP_RANK": "1"}
SLURM_VARS = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
              "SLURM_JOB_NODELIST": "gpu[003-005,7],cpu1", "SLURM_JOB_ID": "123456", "SLURM_JOB_NAME": "train"}


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher or SLURM variable set, whatever shell runs the tests."""
    for key in list(os.environ):
        if key in LAUNCH_VARIABLES or key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    return monkeypatch


def _set(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str]) -> None:
    for key, value in variables.items():
        monkeypatch.setenv(key, value)


# -- detection -----------------------------------------------------------------------------------------

def test_nothing_set_is_a_local_run(bare_env: pytest.MonkeyPatch) -> None:
    assert not TorchElasticEnvironment.detect() and not SLURMEnvironment.detect()
    env = detect_environment()
    assert type(env) is LocalEnvironment and not env.creates_processes_externally
    assert (env.global_rank(), env.local_rank(), env.world_size(), env.node_rank()) == (0, 0, 1, 0)
    assert (env.main_address, env.main_port) == ("127.0.0.1", 0)


def test_torchrun_variables(bare_env: pytest.MonkeyPatch) -> None:
    _set(bare_env, TORCHRUN_VARS)
    env = detect_environment()
    assert type(env) is TorchElasticEnvironment and env.creates_processes_externally
    assert (env.global_rank(), env.local_rank(), env.world_size(), env.node_rank()) == (3, 1, 4, 1)
    assert (env.main_address, env.main_port) == ("10.0.0.7", 29511)


@pytest.mark.parametrize("missing", ["TORCHELASTIC_RUN_ID", "MASTER_PORT", "RANK"])
def test_torchrun_needs_all_its_variables(bare_env: pytest.MonkeyPatch, missing: str) -> None:
    _set(bare_env, {k: v for k, v in TORCHRUN_VARS.items() if k != missing})
    assert not TorchElasticEnvironment.detect()


def test_slurm_variables(bare_env: pytest.MonkeyPatch) -> None:
    _set(bare_env, SLURM_VARS)
    env = detect_environment()
    assert type(env) is SLURMEnvironment and env.creates_processes_externally
    assert (env.global_rank(), env.local_rank(), env.world_size(), env.node_rank()) == (5, 1, 8, 1)
    assert env.main_address == "gpu003"


@pytest.mark.parametrize("job_name", ["bash", "interactive"])
def test_interactive_slurm_shell_is_local(bare_env: pytest.MonkeyPatch, job_name: str) -> None:
    _set(bare_env, {**SLURM_VARS, "SLURM_JOB_NAME": job_name})
    assert not SLURMEnvironment.detect()
    assert type(detect_environment()) is LocalEnvironment


def test_torchrun_wins_over_slurm(bare_env: pytest.MonkeyPatch) -> None:
    # torchrun inside an sbatch allocation: torchrun made these processes, not srun.
    _set(bare_env, {**SLURM_VARS, **TORCHRUN_VARS})
    assert type(detect_environment()) is TorchElasticEnvironment


def test_rank_getters_follow_the_environment(bare_env: pytest.MonkeyPatch) -> None:
    env = LocalEnvironment()
    bare_env.setenv("RANK", "1")
    bare_env.setenv("WORLD_SIZE", "2")
    assert (env.global_rank(), env.world_size()) == (1, 2)


# -- SLURM address and port ----------------------------------------------------------------------------

@pytest.mark.parametrize("nodelist, first", [
    ("gpu[003-005,7],cpu1", "gpu003"),
    ("node1", "node1"),
    ("node[7]", "node7"),
    ("a-b[10,2-3]", "a-b10"),
    ("host1,host2", "host1"),
    ("127.0.0.1", "127.0.0.1"),
])
def test_first_hostname(nodelist: str, first: str) -> None:
    assert first_hostname(nodelist) == first


def test_slurm_main_address_prefers_master_addr(bare_env: pytest.MonkeyPatch) -> None:
    _set(bare_env, {**SLURM_VARS, "MASTER_ADDR": "10.1.1.1"})
    assert SLURMEnvironment().main_address == "10.1.1.1"


def test_slurm_main_address_from_plain_nodelist(bare_env: pytest.MonkeyPatch) -> None:
    _set(bare_env, {**SLURM_VARS, "SLURM_JOB_NODELIST": "node1"})
    assert SLURMEnvironment().main_address == "node1"


def test_slurm_port_from_job_id(bare_env: pytest.MonkeyPatch) -> None:
    _set(bare_env, SLURM_VARS)
    env = SLURMEnvironment()
    port = env.main_port
    assert 1024 < port < 65536 and port == 20000 + 123456 % 20000
    bare_env.setenv("SLURM_JOB_ID", "123457")
    assert env.main_port == port + 1  # another job, another port
    bare_env.setenv("MASTER_PORT", "31000")
    assert env.main_port == 31000


# -- settings checks -----------------------------------------------------------------------------------

def test_local_rejects_several_nodes() -> None:
    assert LocalEnvironment().validate_settings(2, 1) == []
    (problem,) = LocalEnvironment().validate_settings(2, 2)
    assert "trainer.num_nodes=2" in problem


def test_torchrun_world_size_mismatch(bare_env: pytest.MonkeyPatch) -> None:
    _set(bare_env, TORCHRUN_VARS)  # WORLD_SIZE=4
    env = TorchElasticEnvironment()
    assert env.validate_settings(2, 2) == []
    assert env.validate_settings(4, 1) == []
    (problem,) = env.validate_settings(2, 1)
    assert "trainer.devices=2" in problem and "trainer.num_nodes=1" in problem
    assert "torchrun started 4" in problem


def test_slurm_world_size_mismatch(bare_env: pytest.MonkeyPatch) -> None:
    _set(bare_env, SLURM_VARS)  # SLURM_NTASKS=8
    env = SLURMEnvironment()
    assert env.validate_settings(4, 2) == []
    (problem,) = env.validate_settings(4, 1)
    assert "trainer.devices=4" in problem and "trainer.num_nodes=1" in problem
    assert "srun started 8" in problem


# -- a simulated srun job ------------------------------------------------------------------------------

def _job_port() -> tuple[int, int]:
    """A SLURM job id whose derived port (20000 + id % 20000) is free here, and that port.

    The port stays below 32768, where Linux picks the ports of outgoing connections, so nothing takes it meanwhile.
    """
    rng = random.Random()
    for _ in range(200):
        job_id = rng.randrange(1, 12768) + 20000 * rng.randrange(0, 50)
        port = 20000 + job_id % 20000
        if port_is_free(port):
            return job_id, port
    raise RuntimeError("no free port in 20000-32767")


@pytest.mark.slow
def test_srun_two_tasks_share_one_run_folder(tmp_path: Path) -> None:
    """What `srun -n2 python -m runner ... cluster=slurm` starts: both tasks finish, in one run folder."""
    job_id, _ = _job_port()
    args = [sys.executable, "-m", "runner", "strategy=ddp", "accelerator=cpu", "trainer.devices=2",
            "cluster=slurm", "data.num_samples=128", "data.val_samples=40", "data.batch_size=16",
            "trainer.max_steps=3", "trainer.max_epochs=-1"]
    tasks = []
    for rank in (0, 1):
        env = clean_environ(SLURM_NTASKS="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                            SLURM_JOB_NODELIST="127.0.0.1", SLURM_JOB_ID=str(job_id), SLURM_JOB_NAME="test")
        tasks.append(subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        outputs = [task.communicate(timeout=120) for task in tasks]
    finally:
        for task in tasks:
            task.kill()
    report = "\n".join(f"task {r}: exit {t.returncode}\nstdout:\n{o}\nstderr:\n{e}"
                       for r, (t, (o, e)) in enumerate(zip(tasks, outputs)))
    assert [task.returncode for task in tasks] == [0, 0], report
    # Named after the job (and step), so a requeued job finds its own folder again.
    runs = [p for p in (tmp_path / "outputs").iterdir()]
    assert [p.name for p in runs] == [f"slurm-{job_id}-0"], f"{runs}\n{report}"
    run_dir = runs[0]
    assert_one_run_folder(run_dir)
    assert "global batch 32" in (run_dir / "runner.log").read_text()
