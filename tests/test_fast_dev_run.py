"""trainer.fast_dev_run, as Lightning's: N batches of each loop (train, val, test, predict), no checkpoint files
(best.ckpt included), no logger files."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import pytest
from omegaconf import DictConfig

import runner

MakeCfg = Callable[..., DictConfig]
EVERYTHING = ("callbacks=[model_checkpoint,early_stopping]", "logger=[tensorboard,csv]", "data.test_samples=64")


def _samples(run_dir: Path, split: str) -> list[int]:
    """The sample counts of the `<split>/...` lines of runner.log, in order."""
    log = (run_dir / "runner.log").read_text()
    return [int(n) for n in re.findall(rf"  {split}/loss .*\((\d+) samples, ", log)]


@pytest.mark.parametrize(("overrides", "batches", "processes"), [
    (("trainer.fast_dev_run=true",), 1, 1),
    (("trainer.fast_dev_run=2",), 2, 1),
    (("trainer.fast_dev_run=true", "strategy=ddp", "trainer.devices=2"), 1, 2),
], ids=["true", "two", "ddp-2"])
def test_one_batch_of_each_loop_and_no_files(make_cfg: MakeCfg, tmp_path: Path, overrides: tuple, batches: int,
                                             processes: int) -> None:
    metrics = runner.fit(make_cfg(*EVERYTHING, *overrides, "trainer.max_steps=50"), run_dir=tmp_path)
    assert metrics["step"] == batches and metrics["tested"] == "last"
    per_loop = batches * 16 * processes  # data.batch_size=16 per process
    assert _samples(tmp_path, "val") == [per_loop] and _samples(tmp_path, "test") == [per_loop]  # of 64 each
    assert not (tmp_path / "checkpoints").exists()
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "metrics.csv").exists()
    assert "best_model_path" not in metrics
    assert json.loads((tmp_path / "metrics.json").read_text())["step"] == batches
    assert "no checkpoints, no loggers, callbacks model_checkpoint, early_stopping off" in (
        tmp_path / "runner.log").read_text()


def test_test_and_predict_stages_run_the_first_batches(make_cfg: MakeCfg, tmp_path: Path) -> None:
    runner.fit(make_cfg("data.test_samples=64"), run_dir=tmp_path / "fit")
    last = f"trainer.ckpt_path={tmp_path / 'fit' / 'checkpoints' / 'last.ckpt'}"
    runner.fit(make_cfg("data.test_samples=64", "stage=test", last, "trainer.fast_dev_run=2"), run_dir=tmp_path / "test")
    assert _samples(tmp_path / "test", "test") == [32]
    assert not (tmp_path / "test" / "tensorboard").exists()
    predicted = runner.fit(make_cfg("data.test_samples=64", "stage=predict", last, "trainer.fast_dev_run=true"),
                           run_dir=tmp_path / "predict")
    assert predicted["num_predictions"] == 16
