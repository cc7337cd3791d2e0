"""Sweeps: every job a full multi-process run in its own folder, a summary table, failures and re-runs."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package (hydra_plugins) is not there either
        return False


TINY = ["data.num_samples=512", "data.val_samples=100", "trainer.log_every_n_steps=5"]


def runner(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def read_summary(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "summary.csv") as f:
        return list(csv.DictReader(f))


def config_hashes(log_file: Path) -> set[str]:
    return set(re.findall(r"config hash ([0-9a-f]+)", log_file.read_text()))


def test_ddp_sweep_gives_each_job_its_own_full_run(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = runner("-m", "optimizer.lr=0.1,0.01", "strategy=ddp", "accelerator=cpu", "trainer.devices=2",
                    "trainer.max_steps=10", f"hydra.sweep.dir={sweep}", *TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()
    lrs = []
    for job in ("0", "1"):
        job_dir = sweep / job
        assert len(list((job_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
        assert "val/loss" in json.loads((job_dir / "metrics.json").read_text())
        lrs.append(yaml.safe_load((job_dir / ".hydra" / "config.yaml").read_text())["optimizer"]["lr"])
        # Both ranks of a job trained the same config (each checks it against rank 0's at start-up).
        hashes = config_hashes(job_dir / "runner.log") | config_hashes(job_dir / "rank_1.log")
        assert len(hashes) == 1
    assert lrs == [0.1, 0.01]
    assert config_hashes(sweep / "0" / "runner.log") != config_hashes(sweep / "1" / "runner.log")
    rows = read_summary(sweep)
    assert [r["job"] for r in rows] == ["0", "1"]
    assert all(r["status"] == "ok" and float(r["val/loss"]) > 0 for r in rows)
    assert "optimizer.lr=0.1" in rows[0]["overrides"]
    assert "| job |" in (sweep / "summary.md").read_text()


def test_failed_job_is_recorded_and_others_still_run(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # data.batch_size=0 fails validation in its job only.
    result = runner("-m", "data.batch_size=0,32", "trainer.max_steps=3", f"hydra.sweep.dir={sweep}", *TINY,
                    cwd=tmp_path)
    assert result.returncode == 1
    assert "data.batch_size=0" in result.stderr and "Traceback" not in result.stderr
    rows = {r["job"]: r for r in read_summary(sweep)}
    assert rows["0"]["status"] == "failed" and "data.batch_size" in rows["0"]["error"]
    assert rows["1"]["status"] == "ok"
    assert (sweep / "1" / "metrics.json").exists()
    assert (sweep / "summary.md").read_text().startswith(
        "2 job(s): 1 passed, 1 failed; the first failed: job 0 (data.batch_size=0 trainer.max_steps=3 ")


def _finished_job(sweep: Path, job: str, status: str, overrides: list[str], loss: float) -> None:
    (sweep / job / ".hydra").mkdir(parents=True)
    (sweep / job / ".hydra" / "job_status.json").write_text(json.dumps({"status": status, "error": "boom"}))
    (sweep / job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (sweep / job / "metrics.json").write_text(json.dumps({"val/loss": loss}))


def test_the_summary_opens_with_the_counts_and_ranks_only_jobs_that_compare(tmp_path: Path) -> None:
    """A nightly `-m 'experiment=glob(*)' trainer.fast_dev_run=true`: how many passed comes first, and no job is
    named best, neither over one batch nor across experiments."""
    from runner.sweep import _write_summary

    jobs = {"0": ("ok", "experiment=charlm", 0.2), "1": ("failed", "experiment=digits", 9.0),
            "2": ("ok", "experiment=shapes", 0.9), "3": ("stopped", "experiment=tiny_bert", 0.5)}
    for smoke in (True, False):
        sweep = tmp_path / str(smoke)
        for job, (status, experiment, loss) in jobs.items():
            _finished_job(sweep, job, status, [experiment, f"trainer.fast_dev_run={smoke}"], loss)
        _write_summary(sweep, "val/loss", "minimize", smoke=smoke)
        lines = (sweep / "summary.md").read_text().splitlines()
        assert lines[0] == ("4 job(s): 2 passed, 1 failed, 1 stopped; the first failed: job 1 (experiment=digits "
                            f"trainer.fast_dev_run={smoke}): boom.")
        assert lines[1] == ("No best job: trainer.fast_dev_run runs one batch per loop, a smoke test whose val/loss "
                            "ranks nothing." if smoke else
                            "No best job: the jobs run 4 different experiments, whose val/loss values do not compare.")
        assert [r["best"] for r in read_summary(sweep)] == ["", "", "", ""]


def test_rerunning_a_finished_sweep_trains_nothing(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ("-m", "optimizer.lr=0.1,0.01", "trainer.max_steps=5", f"hydra.sweep.dir={sweep}", *TINY)
    assert runner(*args, cwd=tmp_path).returncode == 0
    checkpoints = {p: p.stat().st_mtime_ns for p in sweep.glob("*/checkpoints/last.ckpt")}
    again = runner(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("skipped") + again.stdout.count("skipped") == 2
    assert {p: p.stat().st_mtime_ns for p in sweep.glob("*/checkpoints/last.ckpt")} == checkpoints
    assert len(read_summary(sweep)) == 2


def test_unfinished_job_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    first = runner("-m", "optimizer.lr=0.1", "trainer.max_steps=4", f"hydra.sweep.dir={sweep}", *TINY, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    # The same job asked for more steps is not "finished": it continues from step 4.
    second = runner("-m", "optimizer.lr=0.1", "trainer.max_steps=8", f"hydra.sweep.dir={sweep}", *TINY, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "resuming from" in (sweep / "0" / "runner.log").read_text()
    assert json.loads((sweep / "0" / "metrics.json").read_text())["step"] == 8


def test_sweep_preset_runs_as_a_sweep(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = runner("experiment=lr_sweep", "trainer.max_steps=3", f"hydra.sweep.dir={sweep}", *TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(read_summary(sweep)) == 3


@pytest.mark.skipif(
    not installed("hydra_plugins.hydra_joblib_launcher"),
    reason="needs the sweep extra (hydra-joblib-launcher)",
)
def test_joblib_launcher_runs_jobs_in_parallel_processes(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = runner("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "optimizer.lr=0.1,0.01",
                    "trainer.max_steps=3", f"hydra.sweep.dir={sweep}", *TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [r["status"] for r in read_summary(sweep)] == ["ok", "ok"]


@pytest.mark.skipif(
    not installed("hydra_plugins.hydra_submitit_launcher"),
    reason="needs the sweep extra (hydra-submitit-launcher)",
)
def test_submitit_local_launcher_runs_ddp_jobs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = runner("-m", "hydra/launcher=submitit_local", "optimizer.lr=0.1,0.01", "strategy=ddp",
                    "accelerator=cpu", "trainer.devices=2", "trainer.max_steps=3", f"hydra.sweep.dir={sweep}", *TINY,
                    cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [r["status"] for r in read_summary(sweep)] == ["ok", "ok"]
    assert (sweep / "1" / "rank_1.log").exists()


def test_a_sweep_with_other_values_in_the_same_folder_does_not_reuse_old_jobs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    assert runner("-m", "optimizer.lr=0.1", "trainer.max_steps=4", f"hydra.sweep.dir={sweep}", *TINY,
                  cwd=tmp_path).returncode == 0
    again = runner("-m", "optimizer.lr=0.5", "trainer.max_steps=4", f"hydra.sweep.dir={sweep}", *TINY, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "resuming from" not in (sweep / "0" / "runner.log").read_text().split("another config")[-1]
    assert json.loads((sweep / "0" / "metrics.json").read_text())["lr"] == 0.5
    assert len(list((sweep / "0" / "tensorboard").glob("events.out.tfevents.*"))) == 1
    [row] = read_summary(sweep)
    assert "optimizer.lr=0.5" in row["overrides"] and float(row["lr"]) == 0.5


def test_the_summary_names_the_best_job_by_objective_and_direction(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = runner("-m", "optimizer.lr=0.05,0.0001", "objective=val/acc", "direction=maximize",
                    "trainer.max_steps=5", f"hydra.sweep.dir={sweep}", *TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = read_summary(sweep)
    accuracies = {r["job"]: float(r["val/acc"]) for r in rows}
    assert len(set(accuracies.values())) == 2, accuracies  # else any pick would look right
    best = max(accuracies, key=accuracies.get)
    assert [r["job"] for r in rows if r["best"] == "yes"] == [best]
    counts, best_line = (sweep / "summary.md").read_text().splitlines()[:2]
    assert counts == "2 job(s): 2 passed, 0 failed."
    assert best_line.startswith(f"Best job by val/acc (maximize): {best}, val/acc = ")


@pytest.mark.parametrize(("direction", "pick"), [("minimize", "1"), ("maximize", "0")])
def test_best_job_follows_the_direction_and_skips_failed_jobs(direction: str, pick: str) -> None:
    from runner.sweep import best_job

    rows = [{"job": "0", "status": "ok", "val/loss": 0.9}, {"job": "1", "status": "ok", "val/loss": 0.2},
            {"job": "2", "status": "failed", "val/loss": 0.1}, {"job": "3", "status": "ok", "val/loss": float("nan")},
            {"job": "4", "status": "ok"}]
    assert best_job(rows, "val/loss", direction)["job"] == pick


def _sweeper_config(direction: str, *hydra_overrides: str) -> DictConfig:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"objective": "val/acc", "direction": direction,
                            "hydra": {"sweeper": {"direction": "minimize", "n_trials": 2},
                                      "overrides": {"hydra": list(hydra_overrides)}}})
    OmegaConf.set_readonly(cfg.hydra, True)  # as Hydra hands it over
    return cfg


def test_direction_reaches_a_sweeper_that_has_one(capsys: pytest.CaptureFixture) -> None:
    from runner.config import ConfigError
    from runner.sweep import SweepDirection, set_sweeper_direction

    cfg = _sweeper_config("maximize")
    SweepDirection().on_multirun_start(config=cfg)
    assert cfg.hydra.sweeper.direction == "maximize"
    with pytest.raises(ConfigError, match="hydra.sweeper.direction=minimize contradicts direction=maximize"):
        set_sweeper_direction(_sweeper_config("maximize", "hydra.sweeper.direction=minimize"))
    # Hydra makes a callback's exceptions warnings: the callback itself ends the process before the sweep.
    with pytest.raises(SystemExit) as stopped:
        SweepDirection().on_multirun_start(config=_sweeper_config("up"))
    assert stopped.value.code == 1
    assert "direction=up is not allowed: use minimize or maximize" in capsys.readouterr().err


OPTUNA = pytest.mark.skipif(not installed("hydra_plugins.hydra_optuna_sweeper"),
                            reason="needs the optuna extra (hydra-optuna-sweeper)")


@OPTUNA
def test_optuna_maximizes_when_direction_says_maximize(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # A grid over two learning rates: each trial once, with different accuracies, so Optuna's pick shows its direction.
    result = runner("hparams_search=optuna", "hydra/sweeper/sampler=grid", "hydra.sweeper.n_trials=2",
                    "hydra.sweeper.params={optimizer.lr:'choice(0.05,0.0001)',model.hidden:'choice(16)'}",
                    "trainer.max_steps=5",
                    f"hydra.sweep.dir={sweep}", *TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Directions: ['maximize']" in result.stdout + result.stderr
    accuracies = {r["job"]: float(r["val/acc"]) for r in read_summary(sweep)}
    assert len(accuracies) == 2 and len(set(accuracies.values())) == 2, accuracies
    found = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert found["best_value"] == pytest.approx(max(accuracies.values()))
    best = max(accuracies, key=accuracies.get)
    assert [r["job"] for r in read_summary(sweep) if r["best"] == "yes"] == [best]


@OPTUNA
def test_a_sweeper_direction_against_direction_is_refused(tmp_path: Path) -> None:
    result = runner("hparams_search=optuna", "hydra.sweeper.direction=minimize", f"hydra.sweep.dir={tmp_path / 's'}",
                    cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    assert "hydra.sweeper.direction=minimize contradicts direction=maximize" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").glob("*/metrics.json"))
