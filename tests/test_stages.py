"""Stages: fit then test, validate, test and predict from a checkpoint; 2 processes give what 1 process gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

import runner
from conftest import load_checkpoint
from runner.config import ConfigError
from runner.build import build_data, build_model
from runner.checks import validate

MakeCfg = Callable[..., DictConfig]
DDP2 = ("strategy=ddp", "trainer.devices=2")
TEST = ("data.test_samples=333", "data.val_samples=33")  # 333 does not split evenly over 2 processes


def direct(cfg: DictConfig, checkpoint: Path) -> tuple[torch.Tensor, float, float]:
    """The checkpoint's model on the whole test set, computed here: logits, loss, accuracy."""
    model = build_model(cfg)
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    data = build_data(cfg).test_dataset
    with torch.no_grad():
        logits = model(data.inputs)
    loss = F.cross_entropy(logits, data.targets).item()
    return logits, loss, (logits.argmax(1) == data.targets).float().mean().item()


def test_fit_tests_the_best_checkpoint_when_the_data_has_a_test_set(make_cfg: MakeCfg, tmp_path: Path) -> None:
    cfg = make_cfg(*TEST, "callbacks=model_checkpoint", "trainer.max_steps=12", "trainer.val_check_interval=3",
                   "optimizer.lr=0.05")
    metrics = runner.fit(cfg, run_dir=tmp_path)
    best = tmp_path / "checkpoints" / "best.ckpt"
    assert metrics["tested"] == str(best)
    _, loss, accuracy = direct(cfg, best)
    assert metrics["test/loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["test/acc"] == pytest.approx(accuracy, abs=1e-6)
    assert json.loads((tmp_path / "metrics.json").read_text())["test/loss"] == pytest.approx(loss, rel=1e-5)


def test_fit_without_a_best_checkpoint_tests_the_last_weights(make_cfg: MakeCfg, tmp_path: Path) -> None:
    cfg = make_cfg(*TEST)
    metrics = runner.fit(cfg, run_dir=tmp_path)
    assert metrics["tested"] == "last"
    assert metrics["test/loss"] == pytest.approx(direct(cfg, tmp_path / "checkpoints" / "last.ckpt")[1], rel=1e-5)


@pytest.mark.parametrize("devices", [1, 2], ids=["1-process", "2-processes"])
def test_validate_test_and_predict_from_a_checkpoint(make_cfg: MakeCfg, tmp_path: Path, devices: int) -> None:
    trained = tmp_path / "trained"
    runner.fit(make_cfg(*TEST, "trainer.max_steps=6"), run_dir=trained)
    ckpt = trained / "checkpoints" / "last.ckpt"
    ddp = DDP2 if devices == 2 else ()
    cfg = make_cfg(*TEST, *ddp, "stage=test", f"trainer.ckpt_path={ckpt}")
    tested = runner.fit(cfg, run_dir=tmp_path / "test")
    logits, loss, accuracy = direct(cfg, ckpt)
    assert tested["test/loss"] == pytest.approx(loss, rel=1e-5) and tested["step"] == 6
    assert tested["test/acc"] == pytest.approx(accuracy, abs=1e-6)
    assert not (tmp_path / "test" / "checkpoints").exists()  # evaluating trains nothing, saves nothing
    validated = runner.fit(make_cfg(*TEST, *ddp, "stage=validate", f"trainer.ckpt_path={ckpt}"),
                           run_dir=tmp_path / "validate")
    assert validated["val/loss"] == pytest.approx(load_checkpoint(trained)["metrics"]["val/loss"], rel=1e-5)
    runner.fit(make_cfg(*TEST, *ddp, "stage=predict", f"trainer.ckpt_path={ckpt}"), run_dir=tmp_path / "predict")
    predictions = torch.load(tmp_path / "predict" / "predictions.pt", weights_only=True)["predictions"]
    assert predictions.shape == (333, 4)  # every sample once, in the data set's order
    torch.testing.assert_close(predictions, logits, atol=1e-5, rtol=0)


def test_ckpt_path_best_finds_the_best_of_a_run_of_the_same_config(make_cfg: MakeCfg, tmp_path: Path) -> None:
    runs = tmp_path / "outputs" / "2030-01-01"
    runner.fit(make_cfg(*TEST, "callbacks=model_checkpoint", "trainer.max_steps=4", "optimizer.lr=0.05"),
               run_dir=runs / "00-00-00")
    cfg = make_cfg(*TEST, "stage=test", "trainer.ckpt_path=best")  # the optimizer plays no part in a test
    metrics = runner.fit(cfg, run_dir=runs / "00-00-01")
    best = runs / "00-00-00" / "checkpoints" / "best.ckpt"
    assert metrics["test/loss"] == pytest.approx(direct(cfg, best)[1], rel=1e-5)
    assert f"stage=test with the weights of {best}" in (runs / "00-00-01" / "runner.log").read_text()
    with pytest.raises(ConfigError, match=r"trainer\.ckpt_path=best: no checkpoints/best\.ckpt in .*model_checkpoint"):
        runner.fit(make_cfg(*TEST, "model.hidden=32", "stage=test", "trainer.ckpt_path=best"),
                   run_dir=runs / "00-00-02")  # another model: not the same config


def test_testing_the_best_checkpoint_in_the_fits_folder_leaves_the_fits_record(make_cfg: MakeCfg,
                                                                             tmp_path: Path) -> None:
    """stage=test trainer.ckpt_path=best in the fit's own folder writes its record in a folder of its own there: the
    fit's metrics.json, resolved config and event files stay (metrics.json was replaced, and `best` from a new folder
    was refused afterwards)."""
    runs = tmp_path / "outputs" / "2030-01-01"
    fit = runs / "00-00-00"
    runner.fit(make_cfg(*TEST, "callbacks=model_checkpoint", "trainer.max_steps=4", "optimizer.lr=0.05"), run_dir=fit)
    kept = {path: path.read_bytes() for path in (fit / "metrics.json", fit / ".hydra" / "resolved.yaml",
                                                  *(fit / "tensorboard").iterdir())}
    tested = runner.fit(make_cfg(*TEST, "stage=test", "trainer.ckpt_path=best"), run_dir=fit)
    assert {path: path.read_bytes() for path in kept} == kept and set((fit / "tensorboard").iterdir()) <= set(kept)
    assert json.loads((fit / "test" / "metrics.json").read_text())["test/loss"] == tested["test/loss"]
    again = runner.fit(make_cfg(*TEST, "stage=test", "trainer.ckpt_path=best"), run_dir=runs / "00-00-01")
    assert again["test/loss"] == tested["test/loss"]


@pytest.mark.parametrize(("overrides", "message"), [
    (("stage=test",), r"stage=test needs the weights to use: trainer\.ckpt_path=<file>, last or best"),
    (("stage=train",), r"stage=train is not allowed: use fit, validate, test, predict, check"),
])
def test_bad_stages_are_refused_before_start(make_cfg: MakeCfg, overrides: tuple, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(*overrides))


def test_stage_test_without_a_test_set_says_what_is_missing(make_cfg: MakeCfg, tmp_path: Path) -> None:
    runner.fit(make_cfg("trainer.max_steps=2"), run_dir=tmp_path / "trained")
    cfg = make_cfg("stage=test", f"trainer.ckpt_path={tmp_path / 'trained' / 'checkpoints' / 'last.ckpt'}")
    with pytest.raises(ConfigError, match=r"stage=test needs a test_dataset, but the data \(SyntheticClassification\)"):
        runner.fit(cfg, run_dir=tmp_path / "test")


def test_fit_then_test_on_two_processes_with_async_checkpoints(make_cfg: MakeCfg, tmp_path: Path) -> None:
    overrides = (*TEST, "callbacks=model_checkpoint", "trainer.max_steps=8", "trainer.val_check_interval=2",
                 "optimizer.lr=0.05", "checkpoint_io=async")
    two = runner.fit(make_cfg(*overrides, *DDP2, "data.batch_size=8"), run_dir=tmp_path / "two")
    one = runner.fit(make_cfg(*overrides, "data.batch_size=16"), run_dir=tmp_path / "one")
    assert two["best_step"] == one["best_step"]
    assert two["test/loss"] == pytest.approx(one["test/loss"], rel=1e-5)
    assert two["test/loss"] == pytest.approx(direct(make_cfg(*TEST), tmp_path / "two" / "checkpoints" / "best.ckpt")[1],
                                             rel=1e-5)


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_evaluating_the_last_checkpoint_of_no_run_is_refused(make_cfg: MakeCfg, tmp_path: Path, stage: str) -> None:
    """No run of this config has trained: evaluating 'last' would score random weights (fit starts afresh instead)."""
    cfg = make_cfg(f"stage={stage}", "trainer.ckpt_path=last", "data.test_samples=64")
    with pytest.raises(ConfigError, match=rf"trainer\.ckpt_path=last: no last\.ckpt .* stage={stage} needs trained"):
        runner.fit(cfg, run_dir=tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.json").exists() and not (tmp_path / "run" / "predictions.pt").exists()
