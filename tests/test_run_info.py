"""The start line that names what ran where (devices, backend, precision, world size, strategy), its record in
metrics.json and the hyperparameters, and the trainer's progress_bar key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from omegaconf import DictConfig
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

import runner
from runner.checks import validate
from runner.config import ConfigError

from conftest import read_events

MakeCfg = Callable[..., DictConfig]


@pytest.mark.parametrize("value", ["auto", "true", "false"])
def test_progress_bar_takes_auto_true_false(make_cfg: MakeCfg, value: str) -> None:
    validate(make_cfg(f"trainer.progress_bar={value}"))


def test_progress_bar_refuses_other_values(make_cfg: MakeCfg) -> None:
    with pytest.raises(ConfigError, match=r"trainer.progress_bar=maybe is not allowed: use auto .*, true or false"):
        validate(make_cfg("trainer.progress_bar=maybe"))


@pytest.mark.parametrize(("overrides", "line", "backend"), [
    ((), "devices: 1 × cpu (no process group), precision 32-true, world size 1, strategy single", "none"),
    (("strategy=ddp", "trainer.devices=2"), "devices: 2 × cpu (gloo), precision 32-true, world size 2, strategy ddp",
     "gloo"),
], ids=["one-process", "ddp-2"])
def test_the_start_line_names_devices_backend_precision_and_world_size(make_cfg: MakeCfg, tmp_path: Path,
                                                                       overrides: tuple, line: str,
                                                                       backend: str) -> None:
    world = 2 if overrides else 1
    runner.fit(make_cfg(*overrides), run_dir=tmp_path)
    log = (tmp_path / "runner.log").read_text()
    assert log.count(line) == 1
    assert log.index(line) < log.index("global batch")  # at the start, before training
    expected = {"accelerator": "cpu", "device_name": "cpu", "devices_per_node": world, "num_nodes": 1,
                "backend": backend, "precision": "32-true", "world_size": world,
                "strategy": "ddp" if overrides else "single"}
    assert json.loads((tmp_path / "metrics.json").read_text())["run"] == expected
    content = read_events(tmp_path).PluginTagToContent("hparams")["_hparams_/session_start_info"]
    values = HParamsPluginData.FromString(content).session_start_info.hparams
    assert {k[len("run/"):]: _value(values[k]) for k in values if k.startswith("run/")} == expected


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
            "backend": "nccl", "precision": "bf16-mixed", "world_size": 16, "strategy": "fsdp"}
    assert run_line(info) == ("devices: 8 × cuda NVIDIA H200 × 2 nodes (nccl), precision bf16-mixed, world size 16, "
                              "strategy fsdp")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_run_names_it(make_cfg: MakeCfg, tmp_path: Path) -> None:
    metrics = runner.fit(make_cfg("accelerator=cuda", "precision=bf16-mixed"), run_dir=tmp_path)
    name = torch.cuda.get_device_name(0)
    assert metrics["run"] == {"accelerator": "cuda", "device_name": name, "devices_per_node": 1, "num_nodes": 1,
                              "backend": "none", "precision": "bf16-mixed", "world_size": 1, "strategy": "single"}
    assert f"devices: 1 × cuda {name} (no process group), precision bf16-mixed" in (tmp_path / "runner.log").read_text()
