"""Callbacks turned off over an experiment that tunes them, and what metrics.json says stopped a run."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import runner
from _dist import assert_ok, run_cli
from conftest import TINY
from runner.composition import compose
from runner.config import ConfigError
from runner.checks import validate
from runner.loop import Progress
from runner.loop.results import fit_result

# An experiment of the user's that selects and tunes two callbacks.
TUNED = """\
# @package _global_
defaults:
  - override /callbacks: [early_stopping,model_checkpoint]
callbacks:
  early_stopping:
    patience: 2
  model_checkpoint:
    save_top_k: 2
"""
# Early stopping that must stop at the second validation: nothing improves by 100.
STOPS_AT_2 = ("callbacks=early_stopping", "callbacks.early_stopping.patience=1",
              "callbacks.early_stopping.min_delta=100", "trainer.val_check_interval=1", "trainer.max_steps=6")


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "conf"
    (folder / "experiment").mkdir(parents=True)
    (folder / "experiment" / "tuned.yaml").write_text(TUNED)
    return folder


@pytest.mark.parametrize(("chosen", "summary"), [("none", False), ("[model_summary]", True)])
def test_turning_callbacks_off_drops_the_experiments_settings_for_them(config_dir: Path, tmp_path: Path,
                                                                       chosen: str, summary: bool) -> None:
    run = tmp_path / "run"
    result = run_cli(["--config-dir", str(config_dir), "experiment=tuned", f"callbacks={chosen}", *TINY,
                      f"hydra.run.dir={run}"], cwd=tmp_path)
    assert_ok(result)
    log = (run / "runner.log").read_text()
    assert ("dropped callbacks.early_stopping.patience, callbacks.model_checkpoint.save_top_k: settings of "
            f"callbacks this run does not select (callbacks={chosen})") in log
    assert ("parameters," in log) is summary  # model_summary's line
    assert not (run / "checkpoints" / "best.ckpt").exists()
    resolved = yaml.safe_load((run / ".hydra" / "resolved.yaml").read_text())  # what the workers built
    assert sorted(resolved["callbacks"] or {}) == (["model_summary"] if summary else [])
    assert json.loads((run / "metrics.json").read_text())["step"] == 3


def test_a_selected_callbacks_misspelt_setting_or_name_is_still_refused(config_dir: Path) -> None:
    (config_dir / "experiment" / "tuned.yaml").write_text(TUNED.replace("patience", "patiense"))
    cfg = compose(["experiment=tuned", *TINY], config_dir=config_dir)
    with pytest.raises(ConfigError, match=r"callbacks\.early_stopping\.patiense is not a setting of callbacks\."
                                          r"early_stopping .*\(did you mean patience\?\)"):
        validate(cfg)
    # Turned off, its settings go, misspelt or not.
    assert "early_stopping" not in compose(["experiment=tuned", "callbacks=[model_checkpoint]", *TINY],
                                           config_dir=config_dir).callbacks
    misspelt = compose(["callbacks=early_stopping", "+callbacks.early_stoping.patience=2", *TINY])
    with pytest.raises(ConfigError, match=r"callbacks\.early_stoping must be a callback with a _target_"):
        validate(misspelt)


def test_a_callbacks_stop_is_an_early_stop_and_no_signal(tmp_path: Path) -> None:
    metrics = runner.fit(compose([*TINY, *STOPS_AT_2]), run_dir=tmp_path / "run")
    assert metrics["step"] == 2 and metrics["early_stopping_step"] == 2
    assert metrics["stopped_early"] is True
    assert metrics["stopped_by"].startswith("early_stopping: val/loss did not improve by more than 100")
    assert "stop_signal" not in metrics  # finished: nothing to resume
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["stopped_early"] is True


def test_an_early_stopped_sweep_job_is_finished_not_stopped(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", *TINY, *STOPS_AT_2, f"hydra.sweep.dir={sweep}"]
    assert_ok(run_cli(args, cwd=tmp_path))
    assert json.loads((sweep / "0" / ".hydra" / "job_status.json").read_text())["status"] == "ok"
    again = run_cli(args, cwd=tmp_path)
    assert_ok(again)
    assert "job 0 finished in an earlier run of this sweep: skipped" in again.stdout + again.stderr


def _ending(progress: Progress, max_steps: int = 10) -> SimpleNamespace:
    """What fit_result reads of a loop that took `progress`'s steps of `max_steps`."""
    return SimpleNamespace(progress=progress, schedule=SimpleNamespace(max_steps=max_steps, max_epochs=math.inf),
                           train_step=SimpleNamespace(empty_steps=0, taken=progress.step), last_val_step=-1,
                           strategy=SimpleNamespace(is_global_zero=True))


def test_a_signal_names_itself_as_what_stopped_the_run() -> None:
    result = fit_result(_ending(Progress(step=5, epoch=1, metrics={"train/loss": 0.5})), signal.SIGTERM, None)
    assert result == {"train/loss": 0.5, "step": 5, "epoch": 1, "stopped_early": True,
                      "stop_signal": signal.SIGTERM, "stopped_by": "signal SIGTERM"}
    assert fit_result(_ending(Progress(step=5)), 0, None)["stopped_early"] is False


def test_a_signal_after_the_last_step_stops_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """A SIGTERM that came once every step was taken (at the last one, or in the final validation) made the job end
    as stopped (exit 143, `resume with ...`) though it had finished: the run is complete, and one line says so."""
    result = fit_result(_ending(Progress(step=10, epoch=1)), signal.SIGTERM, None)
    assert result == {"step": 10, "epoch": 1, "stopped_early": False}
    assert "SIGTERM came after the last step (10): the run is complete, nothing to resume" in caplog.text
