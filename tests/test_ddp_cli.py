"""`python -m runner strategy=ddp` on CPU: the run folder of a 2-process job, under the runner's launcher and torchrun,
and the equivalence of 2 processes x batch B with 1 process x 2B."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _dist import assert_ok, assert_one_run_folder, run_cli, torchrun
from conftest import read_events

pytestmark = pytest.mark.slow  # each test starts 2 processes from a fresh interpreter

TWO_CPU = ["strategy=ddp", "accelerator=cpu", "trainer.devices=2", "data=synthetic", "model=mlp"]
SHORT = ["data.num_samples=128", "data.val_samples=40", "data.batch_size=16", "trainer.max_steps=3",
         "trainer.max_epochs=-1", "model.hidden=16"]


@pytest.mark.parametrize("start_method", ["popen", "spawn", "fork"])
def test_two_processes_one_run_folder(tmp_path: Path, start_method: str) -> None:
    run_dir = tmp_path / "run"
    result = run_cli([*TWO_CPU, *SHORT, f"strategy.start_method={start_method}", f"hydra.run.dir={run_dir}"],
                     cwd=tmp_path)
    assert_ok(result)
    assert_one_run_folder(run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["step"] == 3 and "val/loss" in metrics
    assert "global batch 32" in (run_dir / "runner.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written beside the run folder


def test_torchrun_with_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = torchrun([*TWO_CPU, *SHORT, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert_ok(result)
    assert_one_run_folder(run_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert "starting 2 worker processes" not in result.stderr + result.stdout  # torchrun made them


def test_torchrun_default_run_dir_is_created_once(tmp_path: Path) -> None:
    result = torchrun([*TWO_CPU, *SHORT], cwd=tmp_path)
    assert_ok(result)
    runs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(runs) == 1, runs  # rank 1 composes the same config but must not create a folder of its own
    assert_one_run_folder(runs[0])


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


def test_torchrun_with_devices_auto_takes_the_processes_torchrun_started(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = torchrun(["strategy=ddp", "accelerator=cpu", *SHORT, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert_ok(result)
    assert_one_run_folder(run_dir)
    assert "x 2 process(es)" in (run_dir / "runner.log").read_text()
