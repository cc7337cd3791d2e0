"""Holes in logger=mlflow and logger=wandb found from outside: each test fails while its hole is open."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _dist import clean_environ, run_cli

TINY = ["accelerator=cpu", "trainer.max_steps=4", "trainer.log_every_n_steps=2", "data.num_samples=64",
        "data.val_samples=16", "data.batch_size=8", "logger=mlflow"]


@pytest.mark.parametrize("uri", ["htp://127.0.0.1:5000", "sqlite:///{tmp}/a_file/mlflow.db"])
def test_unusable_store_is_one_line_before_training(tmp_path: Path, uri: str) -> None:
    (tmp_path / "a_file").write_text("not a folder")
    result = run_cli([*TINY, f"logger.mlflow.tracking_uri={uri.format(tmp=tmp_path)}"], cwd=tmp_path,
                     env=clean_environ(), timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "invalid config" in output and "logger.mlflow" in output
    assert "Traceback" not in output and "starting at step" not in output


def test_saved_run_of_another_experiment_is_not_continued(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from runner.loggers.mlflow import MLflowLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    theirs = client.create_run(client.create_experiment("another_team")).info.run_id
    client.set_terminated(theirs)
    run_dir = tmp_path / "copied_run"
    run_dir.mkdir()
    (run_dir / "mlflow_run.json").write_text(json.dumps({"tracking_uri": uri, "run_id": theirs}))
    logger = MLflowLogger(str(run_dir), tracking_uri=uri, experiment_name="mine")
    logger.log_metrics({"train/loss": 1.0}, step=1)
    logger.finalize()
    assert client.get_run(theirs).data.metrics == {}
    assert client.get_experiment(client.get_run(logger.run_id).info.experiment_id).name == "mine"


def test_wandb_finalize_does_not_init_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    from runner.loggers.wandb import WandbLogger

    calls = []

    def failing_init(**kwargs):
        calls.append(kwargs)
        raise wandb.errors.CommError("cannot reach the W&B service")

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "resolved.yaml").write_text("stage: fit\n")
    monkeypatch.setattr(wandb, "init", failing_init)
    logger = WandbLogger(str(tmp_path), mode="offline")
    try:
        logger.log_metrics({"train/loss": 1.0}, step=1)
    except wandb.errors.CommError:
        try:
            logger.finalize()  # as the runner's `finally` calls it
        except wandb.errors.CommError:
            pass
    assert len(calls) == 1


def _job_folder(tmp_path: Path) -> Path:
    (tmp_path / ".hydra").mkdir(exist_ok=True)
    (tmp_path / ".hydra" / "resolved.yaml").write_text("stage: fit\n")
    return tmp_path


@pytest.mark.parametrize("uri", ["sqlite:///", "sqlite:///:memory:", "sqlite://"])
def test_an_in_memory_database_is_refused(tmp_path: Path, uri: str) -> None:
    from runner.loggers.mlflow import MLflowLogger

    problems = MLflowLogger(str(_job_folder(tmp_path)), tracking_uri=uri).check_service()
    assert len(problems) == 1 and "in-memory database is lost" in problems[0]


def test_wandb_online_without_a_key_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.loggers.wandb import WandbLogger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    problems = WandbLogger(str(_job_folder(tmp_path)), mode="online").check_service()
    assert len(problems) == 1 and "needs a W&B API key" in problems[0]
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert WandbLogger(str(tmp_path), mode="online").check_service() == []
    assert WandbLogger(str(tmp_path), mode="offline").check_service() == []


def test_requests_to_a_hung_server_are_bounded_below_the_stall_watch(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    from runner.loggers.mlflow import MLflowLogger

    for name in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES"):
        monkeypatch.delenv(name, raising=False)
    MLflowLogger(str(_job_folder(tmp_path)), tracking_uri="http://127.0.0.1:9")
    # Back-off of 2 and 4 s between the tries: well inside the default strategy.stall_timeout of 300 s.
    assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() * (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() + 1) + 6 < 120
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "300")  # the user's own setting wins
    MLflowLogger(str(tmp_path), tracking_uri="http://127.0.0.1:9")
    assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 300
