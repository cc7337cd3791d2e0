"""Settings that ran silently wrong: an explicit task.shift_labels the data contradicts, a damaged mlflow_run.json,
a sqlite tracking URI whose folder does not exist."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from _dist import clean_environ, run_cli
from lm_fixtures import IGNORE, PaddedSequences
from runner.tasks import LanguageModelTask


def _batch() -> dict[str, torch.Tensor]:
    data = PaddedSequences(num_samples=8, val_samples=1, dict_batches=True)
    return data.collate_fn([data.train_dataset[i] for i in range(8)])


def _said(caplog: pytest.LogCaptureFixture, setting: object, batches: list) -> list[str]:
    task = LanguageModelTask(shift_labels=setting)
    with caplog.at_level(logging.INFO, logger="runner"):
        for batch in batches:
            task.units(batch)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_shift_labels_true_on_targets_already_shifted_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    batch = _batch()
    pre_shifted = (batch["input_ids"][:, :-1], batch["labels"][:, 1:])
    said = _said(caplog, True, [pre_shifted, pre_shifted, pre_shifted])
    assert said == ["task.shift_labels=true, but the first batch's labels are not its input_ids (targets already "
                    "shifted, which auto leaves in place): shifted again, each position is scored against the token "
                    "two on"]


def test_shift_labels_false_on_huggingface_labels_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    batch = _batch()
    unscored = {"input_ids": batch["input_ids"], "labels": torch.full_like(batch["labels"], IGNORE)}
    said = _said(caplog, False, [unscored, batch, batch])  # no evidence in the first: the next one is looked at
    assert said == ["task.shift_labels=false, but the first batch's labels equal its input_ids (the HuggingFace "
                    "convention, which auto shifts by one): in place, each position's label is its own input"]


@pytest.mark.parametrize("setting", [True, False])
def test_shift_labels_the_data_agrees_with_says_nothing(caplog: pytest.LogCaptureFixture, setting: bool) -> None:
    batch = _batch()
    agreeing = batch if setting else (batch["input_ids"][:, :-1], batch["labels"][:, 1:])
    assert _said(caplog, setting, [agreeing, agreeing]) == []


def _job_folder(tmp_path: Path) -> Path:
    (tmp_path / ".hydra").mkdir(parents=True, exist_ok=True)
    (tmp_path / ".hydra" / "resolved.yaml").write_text("stage: fit\n")
    return tmp_path


@pytest.mark.parametrize("record", ["{not json", '{"run_id": "0123"}'])
def test_a_damaged_mlflow_run_record_starts_a_new_run_with_a_warning(tmp_path: Path, record: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    from runner.loggers.mlflow import MLflowLogger

    run_dir = _job_folder(tmp_path / "run")
    (run_dir / "mlflow_run.json").write_text(record)
    logger = MLflowLogger(str(run_dir), tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment_name="mine")
    with caplog.at_level(logging.INFO, logger="runner"):
        logger.log_metrics({"train/loss": 1.0}, step=1)
        logger.finalize()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == [f"{run_dir / 'mlflow_run.json'} is damaged (not a JSON record with tracking_uri and run_id): "
                    "starting a new run"]
    assert json.loads((run_dir / "mlflow_run.json").read_text())["run_id"] == logger.run_id  # repaired


def test_a_sqlite_store_in_a_folder_that_does_not_exist_is_refused_before_launch(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent" / "dir"
    result = run_cli(["accelerator=cpu", "trainer.max_steps=2", "data.num_samples=64", "data.val_samples=16",
                      "logger=mlflow", f"logger.mlflow.tracking_uri=sqlite:///{missing}/mlflow.db",
                      f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=clean_environ(), timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert (f"logger.mlflow.tracking_uri=sqlite:///{missing}/mlflow.db: {missing} does not exist; create it "
            f"(mkdir -p {missing}) or name a database in an existing folder") in output, output
    assert not (tmp_path / "nonexistent").exists()
    assert "Traceback" not in output and "starting at step" not in output
