"""The best of a run and of runs: `trainer.ckpt_path=best` by recorded score, a sweep scored by each job's best."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import runner
from _dist import assert_ok, run_cli
from conftest import TINY, compose_config
from runner.checkpoint_search import resolve_ckpt_path
from runner.sweep import _write_summary, objective_value

CHECKPOINTED = (*TINY, "callbacks=model_checkpoint", "trainer.val_check_interval=1", "trainer.max_steps=4")


def test_best_takes_the_run_with_the_best_recorded_score_not_the_newest(tmp_path: Path) -> None:
    runs = tmp_path / "outputs" / "2030-01-01"
    good, worse, by_acc = runs / "00-00-00", runs / "00-00-01", runs / "00-00-02"
    runner.fit(compose_config([*CHECKPOINTED, "optimizer.lr=0.05"]), run_dir=good)
    runner.fit(compose_config([*CHECKPOINTED, "optimizer.lr=0.00001"]), run_dir=worse)  # newer, hardly trained
    # Newest, ranked by accuracy: its score (an accuracy below 1) is no loss to compare.
    runner.fit(compose_config([*CHECKPOINTED, "callbacks.model_checkpoint.monitor=val/acc",
                               "callbacks.model_checkpoint.mode=max"]), run_dir=by_acc)
    scores = {run: json.loads((run / "metrics.json").read_text())["best_model_score"] for run in (good, worse, by_acc)}
    assert scores[good] < scores[worse] and scores[by_acc] < scores[good]  # else any pick would look right

    validate = ["stage=validate", "trainer.ckpt_path=best"]
    assert_ok(run_cli([*TINY, *validate, f"hydra.run.dir={runs / '00-00-03'}"], cwd=tmp_path))
    metrics = json.loads((runs / "00-00-03" / "metrics.json").read_text())
    assert metrics["val/loss"] == pytest.approx(scores[good], rel=1e-5)  # best.ckpt of the best run, validated
    log = (runs / "00-00-03" / "runner.log").read_text()
    assert (f"trainer.ckpt_path=best: using {good / 'checkpoints' / 'best.ckpt'}, of the run with the best val/loss "
            f"(mode min): {scores[good]:.6g}, of 2 run(s) of this config") in log
    cfg = compose_config([*TINY, *validate])
    # A run folder's own best.ckpt, however much better another run's is.
    assert resolve_ckpt_path(cfg, worse) == str(worse / "checkpoints" / "best.ckpt")
    # Ranked by accuracy: the one run that recorded its best accuracy.
    by_accuracy = compose_config([*TINY, "stage=validate", "trainer.ckpt_path=best", "objective=val/acc",
                                  "direction=maximize"])
    assert resolve_ckpt_path(by_accuracy, runs / "00-00-04") == str(by_acc / "checkpoints" / "best.ckpt")


def test_best_without_a_recorded_score_is_refused(tmp_path: Path) -> None:
    from runner.config import ConfigError

    run = tmp_path / "outputs" / "2030-01-01" / "00-00-00"
    runner.fit(compose_config([*CHECKPOINTED, "trainer.max_steps=2"]), run_dir=run)
    (run / "metrics.json").unlink()  # killed before its end: no score recorded
    cfg = compose_config([*TINY, "stage=validate", "trainer.ckpt_path=best"])
    with pytest.raises(ConfigError, match=r"trainer\.ckpt_path=best: 1 run\(s\) of this config under .* hold a "
                                          r"best\.ckpt, but none records a best_model_score by val/loss \(mode min\)"):
        resolve_ckpt_path(cfg, run.parent / "00-00-01")


def _job(sweep: Path, job: str, lr: float, last: float, best: float, step: int) -> None:
    """A finished job's folder as a sweep leaves it, its objective val/acc last at `last`, best at `best`."""
    (sweep / job / ".hydra").mkdir(parents=True)
    (sweep / job / ".hydra" / "job_status.json").write_text(json.dumps({"status": "ok"}))
    (sweep / job / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr={lr}\n")
    (sweep / job / "metrics.json").write_text(json.dumps(
        {"val/acc": last, "val/loss": 1.0, "step": 60, "best": {"metric": "val/acc", "value": best, "step": step}}))


def test_the_summary_ranks_each_job_by_its_best_validation(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    _job(sweep, "0", 0.1, last=0.9198, best=0.926, step=40)  # early stopping: its last is 2 validations later
    _job(sweep, "1", 0.01, last=0.921, best=0.921, step=60)  # the better last value
    _write_summary(sweep, "val/acc", "maximize")
    counts, best = (sweep / "summary.md").read_text().splitlines()[:2]
    assert counts == "2 job(s): 2 passed, 0 failed."
    assert best == ("Best job by val/acc (maximize): 0, val/acc = 0.926, the best of its validations (step 40; "
                    "last 0.9198) (optimizer.lr=0.1).")
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["job"], r["val/acc"], r["val/acc best"], r["val/acc best step"], r["best"]) for r in rows] == [
        ("0", "0.9198", "0.926", "40", "yes"), ("1", "0.921", "0.921", "60", "")]
    _write_summary(sweep, "val/acc", "minimize")  # the direction picks among the best values too
    assert (sweep / "summary.md").read_text().splitlines()[1].startswith(
        "Best job by val/acc (minimize): 1, val/acc = 0.921, the best of its validations")


def test_a_job_gives_the_sweeper_its_best_value_where_recorded() -> None:
    metrics = {"val/acc": 0.9198, "val/loss": 0.3, "best": {"metric": "val/acc", "value": 0.926, "step": 40}}
    assert objective_value(metrics, "val/acc") == 0.926
    assert objective_value(metrics, "val/loss") == 0.3  # no best recorded for it: its last value
    assert objective_value({"train/loss": 0.5}, "val/acc") is None


# -- the objective's best over a run's validations (recorded by the objective check) ------------------------------

def test_the_best_follows_the_direction_and_survives_a_resume() -> None:
    from runner.callbacks import ObjectiveCheck

    for direction, best in (("maximize", [0.9, 20]), ("minimize", [0.5, 10])):
        check = ObjectiveCheck("val/acc", direction)
        for step, value in ((10, 0.5), (20, 0.9), (30, 0.7), (40, float("nan"))):
            check.on_validation_end(None, {"val/acc": value}, step)
        resumed = ObjectiveCheck("val/acc", direction)
        resumed.load_state_dict(check.state_dict())
        result: dict = {"val/acc": 0.7}
        resumed.on_fit_end(None, result)
        assert result == {"val/acc": 0.7, "best": {"metric": "val/acc", "value": best[0], "step": best[1]}}


def _optuna() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _optuna(), reason="needs the optuna extra (hydra-optuna-sweeper)")
def test_a_sweep_under_early_stopping_is_scored_by_each_jobs_best_validation(tmp_path: Path) -> None:
    import yaml

    from conftest import read_events

    sweep = tmp_path / "sweep"
    # Early stopping ends the run 2 validations after its best val/loss: the last is worse.
    assert_ok(run_cli(["hparams_search=optuna", "hydra/sweeper/sampler=grid", "hydra.sweeper.n_trials=1",
                       "hydra.sweeper.params={optimizer.lr:'choice(0.05)'}", "objective=val/loss", "direction=minimize",
                       *TINY, "callbacks=early_stopping", "callbacks.early_stopping.patience=2",
                       "trainer.val_check_interval=2", "trainer.max_steps=60", f"hydra.sweep.dir={sweep}"], cwd=tmp_path))
    val = [(e.step, e.value) for e in read_events(sweep / "0").Scalars("val/loss")]
    best_step, best = min(val, key=lambda item: item[1])
    last = val[-1][1]
    assert val[-3][0] == best_step and last > best  # patience 2 after the best
    metrics = json.loads((sweep / "0" / "metrics.json").read_text())
    assert metrics["val/loss"] == pytest.approx(last, rel=1e-6)  # the last value stays
    assert metrics["best"] == {"metric": "val/loss", "value": pytest.approx(best, rel=1e-6), "step": best_step}
    found = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert found["best_value"] == pytest.approx(best, rel=1e-6)  # what the job gave the sweeper
    assert (f"val/loss = {metrics['best']['value']:.6g}, the best of its validations (step {best_step}; "
            f"last {metrics['val/loss']:.6g})"
            in (sweep / "summary.md").read_text().splitlines()[1])
