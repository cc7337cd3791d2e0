"""`hydra/launcher=submitit_slurm`: one SLURM task per process the job runs (the runner spawns nothing under srun),
derived from trainer.devices and trainer.num_nodes before the sweep submits anything."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.config import ConfigError
from runner.sweep import SLURM_LAUNCHER, set_slurm_tasks


def _config(*task: str, hydra: tuple = (), strategy: str = "DDPStrategy", accelerator: str = "auto_accelerator",
            devices: object = 8, nodes: int = 1, launcher: str = SLURM_LAUNCHER) -> object:
    return OmegaConf.create({
        "trainer": {"devices": devices, "num_nodes": nodes},
        "strategy": {"_target_": f"runner.strategies.{strategy}"},
        "accelerator": {"_target_": f"runner.accelerators.{accelerator}"},
        "hydra": {"launcher": {"_target_": launcher, "tasks_per_node": 1, "nodes": 1, "gpus_per_node": None},
                  "overrides": {"task": list(task), "hydra": list(hydra)}}})


def _asked(config: object) -> dict:
    launcher = config.hydra.launcher  # type: ignore[attr-defined]
    return {key: launcher[key] for key in ("tasks_per_node", "nodes", "gpus_per_node")}


def test_ddp_asks_one_task_and_one_gpu_per_device_on_each_node() -> None:
    config = _config("strategy=ddp", "trainer.devices=8", nodes=2)
    set_slurm_tasks(config)
    assert _asked(config) == {"tasks_per_node": 8, "nodes": 2, "gpus_per_node": 8}


def test_cpu_processes_ask_no_gpu_and_one_process_strategies_one_task() -> None:
    cpu = _config(accelerator="CPUAccelerator", devices=4)
    set_slurm_tasks(cpu)
    assert _asked(cpu) == {"tasks_per_node": 4, "nodes": 1, "gpus_per_node": None}
    dp = _config(strategy="DataParallelStrategy", devices=4)
    set_slurm_tasks(dp)
    assert _asked(dp) == {"tasks_per_node": 1, "nodes": 1, "gpus_per_node": 4}


def test_other_launchers_are_left_alone() -> None:
    local = _config(launcher="hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher")
    set_slurm_tasks(local)
    assert _asked(local) == {"tasks_per_node": 1, "nodes": 1, "gpus_per_node": None}


@pytest.mark.parametrize(("config", "said"), [
    (_config(devices="auto"), "trainer.devices=auto with hydra/launcher=submitit_slurm: give the devices per node as "
                              "a number (e.g. trainer.devices=8): each becomes one SLURM task"),
    (_config("trainer.devices=4,8"), "trainer.devices=4,8 with hydra/launcher=submitit_slurm: the launcher asks SLURM "
                                     "for one number of tasks per sweep"),
    (_config(hydra=("hydra.launcher.tasks_per_node=1",)), "hydra.launcher.tasks_per_node=1 contradicts "
                                                          "trainer.devices=8: drop hydra.launcher.tasks_per_node"),
], ids=["devices-auto", "devices-swept", "contradicting-tasks"])
def test_what_cannot_be_derived_is_one_line(config: object, said: str) -> None:
    with pytest.raises(ConfigError) as raised:
        set_slurm_tasks(config)
    assert len(raised.value.problems) == 1 and said in raised.value.problems[0]


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                    reason="needs the sweep extra (hydra-submitit-launcher)")
def test_the_readme_line_submits_one_task_per_device(tmp_path: Path) -> None:
    """The sbatch script submitit writes, with stand-ins for SLURM's commands (submitting is all they do here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for command, says in (("sbatch", "Submitted batch job 4242"), ("srun", ""), ("sacct", "")):
        (bin_dir / command).write_text(f"#!/bin/sh\necho '{says}'\n")
        (bin_dir / command).chmod(0o755)
    sweep = tmp_path / "sweep"
    job = subprocess.Popen([sys.executable, "-m", "runner", "-m", "hydra/launcher=submitit_slurm",
                            "optimizer.lr=0.1,0.01", "strategy=ddp", "trainer.devices=8", f"hydra.sweep.dir={sweep}"],
                           cwd=tmp_path, env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:  # once submitted, submitit waits for the jobs, which no SLURM runs here
        deadline = time.monotonic() + 90
        while not (scripts := list(sweep.glob(".submitit/**/*.sh"))) and job.poll() is None:
            assert time.monotonic() < deadline, "no sbatch script written"
            time.sleep(0.2)
    finally:
        job.kill()
        _, stderr = job.communicate(timeout=10)
    assert scripts, stderr
    script = scripts[0].read_text()
    assert "#SBATCH --ntasks-per-node=8\n" in script and "#SBATCH --gpus-per-node=8\n" in script, script
