"""After fit the test set is tested when training ended, by its limits or by a callback, not by a stop signal."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

import runner

MakeCfg = Callable[..., DictConfig]


def test_an_early_stopped_run_tests_its_best_checkpoint(make_cfg: MakeCfg, tmp_path: Path) -> None:
    # min_delta=100: no validation after the first improves enough, so patience 1 stops at the second (step 2)
    metrics = runner.fit(make_cfg("callbacks=[early_stopping,model_checkpoint]", "data.test_samples=64",
                                  "callbacks.early_stopping.patience=1", "callbacks.early_stopping.min_delta=100",
                                  "trainer.val_check_interval=1", "trainer.max_steps=10"), run_dir=tmp_path)
    assert metrics["step"] == 2 and "early_stopping" in metrics["stopped_by"] and "stop_signal" not in metrics
    assert metrics["tested"] == str(tmp_path / "checkpoints" / "best.ckpt") and "test/loss" in metrics
