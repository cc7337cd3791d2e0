"""The start line that names what ran where (devices, backend, precision, world size, strategy), its record in
metrics.json and the hyperparameters, and the trainer's progress_bar key."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from omegaconf import DictConfig
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

import runner
from runner.checks import validate
from runner.config import ConfigError

from conftest import compose_config, read_events

MakeCfg = Callable[..., DictConfig]


@pytest.mark.parametrize("value", ["auto", "true", "false"])
def test_progress_bar_takes_auto_true_false(make_cfg: MakeCfg, value: str) -> None:
    validate(make_cfg(f"trainer.progress_bar={value}"))


@pytest.mark.parametrize("value", [0, -2, "two", "true"])
def test_num_threads_refuses_what_is_not_auto_or_a_positive_number(make_cfg: MakeCfg, value: Any) -> None:
    with pytest.raises(ConfigError) as error:
        validate(make_cfg(f"trainer.num_threads={value}"))
    assert error.value.problems == [
        f"trainer.num_threads={value if value != 'true' else True} is not allowed: use auto (OMP_NUM_THREADS when "
        "set, else the CPUs this process may use divided over the processes on its node) or a positive number of "
        "threads per process"]


def test_threads_come_from_the_setting_the_users_omp_num_threads_or_the_usable_cpus_shared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.processes import threads_per_process

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    for key in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(key, raising=False)
    assert [threads_per_process("auto", n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")  # a job's share of a node it does not hold alone
    assert [threads_per_process("auto", n) for n in (1, 2)] == [4, 2]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert [threads_per_process("auto", n) for n in (1, 2)] == [3, 3]
    assert threads_per_process(5, 2) == 5


def test_progress_bar_refuses_other_values(make_cfg: MakeCfg) -> None:
    with pytest.raises(ConfigError, match=r"trainer.progress_bar=maybe is not allowed: use auto .*, true or false"):
        validate(make_cfg("trainer.progress_bar=maybe"))


# The CPUs each run may use: one process on a SLURM job's 1 CPU (torch's default would take every core), two
# processes sharing 6 CPUs of affinity (the launcher gives each 3 threads, where os.cpu_count() gave 1 here).
@pytest.mark.parametrize(("overrides", "cpus", "line", "backend"), [
    ((), {"SLURM_CPUS_PER_TASK": "1"},
     "devices: 1 × cpu (no process group), 1 thread, precision 32-true, world size 1, strategy single", "none"),
    (("strategy=ddp", "trainer.devices=2"), {"affinity": 6},
     "devices: 2 × cpu (gloo), 3 threads per process, precision 32-true, world size 2, strategy ddp", "gloo"),
], ids=["one-process", "ddp-2"])
def test_the_start_line_names_devices_threads_backend_precision_and_world_size(
        make_cfg: MakeCfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: tuple, cpus: dict, line: str,
        backend: str) -> None:
    world = 2 if overrides else 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if "affinity" in cpus:
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cpus["affinity"])))
    else:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", cpus["SLURM_CPUS_PER_TASK"])
    threads = torch.get_num_threads()
    runner.fit(make_cfg(*overrides), run_dir=tmp_path)
    assert torch.get_num_threads() == threads  # the calling program's setting, back
    log = (tmp_path / "runner.log").read_text()
    assert log.count(line) == 1
    assert log.index(line) < log.index("global batch")  # at the start, before training
    expected = {"accelerator": "cpu", "device_name": "cpu", "devices_per_node": world, "num_nodes": 1,
                "num_threads": 3 if overrides else 1, "backend": backend, "precision": "32-true",
                "world_size": world, "strategy": "ddp" if overrides else "single"}
    assert json.loads((tmp_path / "metrics.json").read_text())["run"] == expected
    content = read_events(tmp_path).PluginTagToContent("hparams")["_hparams_/session_start_info"]
    values = HParamsPluginData.FromString(content).session_start_info.hparams
    assert {k[len("run/"):]: _value(values[k]) for k in values if k.startswith("run/")} == expected


def test_the_default_config_runs_without_a_warning_of_the_runners(tmp_path: Path) -> None:
    """`python -m runner` as a new user first types it (two steps): no warning line, no Python warning raised in
    the runner's own code."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.fit(compose_config(["trainer.max_steps=2"]), run_dir=tmp_path)
    runner_dir = Path(runner.__file__).resolve().parent
    assert [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if Path(w.filename).resolve().is_relative_to(runner_dir)] == []
    assert "[WARNING]" not in (tmp_path / "runner.log").read_text()


def test_a_test_stage_records_where_it_ran(make_cfg: MakeCfg, tmp_path: Path) -> None:
    runner.fit(make_cfg("data.test_samples=32"), run_dir=tmp_path / "fit")
    result = runner.fit(make_cfg("data.test_samples=32", "stage=test",
                                 f"trainer.ckpt_path={tmp_path / 'fit' / 'checkpoints' / 'last.ckpt'}"),
                        run_dir=tmp_path / "test")
    assert result["run"]["world_size"] == 1 and result["run"]["strategy"] == "single"
    assert json.loads((tmp_path / "test" / "metrics.json").read_text())["run"] == result["run"]


def _value(value: Any) -> Any:
    kind = value.WhichOneof("kind")
    number = getattr(value, kind)
    return int(number) if kind == "number_value" else number


def test_on_cuda_the_line_names_the_gpu_and_the_nodes() -> None:
    from runner.stages import run_line

    info = {"accelerator": "cuda", "device_name": "NVIDIA H200", "devices_per_node": 8, "num_nodes": 2,
            "num_threads": 4, "backend": "nccl", "precision": "bf16-mixed", "world_size": 16, "strategy": "fsdp"}
    assert run_line(info) == ("devices: 8 × cuda NVIDIA H200 × 2 nodes (nccl), 4 threads per process, precision "
                              "bf16-mixed, world size 16, strategy fsdp")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_run_names_it(make_cfg: MakeCfg, tmp_path: Path) -> None:
    metrics = runner.fit(make_cfg("accelerator=cuda", "precision=bf16-mixed"), run_dir=tmp_path)
    name = torch.cuda.get_device_name(0)
    threads = metrics["run"].pop("num_threads")
    assert metrics["run"] == {"accelerator": "cuda", "device_name": name, "devices_per_node": 1, "num_nodes": 1,
                              "backend": "none", "precision": "bf16-mixed", "world_size": 1, "strategy": "single"}
    assert (f"devices: 1 × cuda {name} (no process group), {threads} thread{'s' if threads > 1 else ''}, precision "
            "bf16-mixed") in (tmp_path / "runner.log").read_text()
