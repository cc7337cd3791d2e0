"""Edges of the issue "Reliability": a value of the wrong type for a typed key is one line, the sweep's bookkeeping
takes concurrent writers, stage=validate with trainer.limit_val_batches=0 is refused, and a NaN monitored metric
is said, not silently skipped."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

import runner
from conftest import TINY, clean_environ, run_main

# -- a value of the wrong type for a typed key --------------------------------------------------------------------

WRONG_TYPES = [
    (["trainer.max_steps=abc"],  # the example is the value before the override (TINY's 3)
     "error: trainer.max_steps=abc is not an integer (trainer.max_steps takes an integer, e.g. trainer.max_steps=3)"),
    (["trainer.max_steps=1e1"],
     "error: trainer.max_steps=1e1 is not an integer (trainer.max_steps takes an integer, e.g. trainer.max_steps=10)"),
    (["trainer.max_steps=1.5"], "error: trainer.max_steps=1.5 is not an integer"),
    (["trainer.max_epochs=x"], "error: trainer.max_epochs=x is not an integer (trainer.max_epochs takes an integer "
                               "or null"),
    (["trainer.deterministic=maybe"], "error: trainer.deterministic=maybe is not true or false"),
    (["-m", "trainer.max_steps=abc,5"], "error: trainer.max_steps=abc is not an integer"),
]


@pytest.mark.parametrize(("overrides", "expected"), WRONG_TYPES, ids=[" ".join(o) for o, _ in WRONG_TYPES])
def test_a_value_of_the_wrong_type_is_one_line_naming_key_value_and_type(
        overrides: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    flags = [o for o in overrides if o == "-m"]  # Hydra's flags come before the overrides
    args = [*flags, *TINY, *(o for o in overrides if o != "-m"), f"hydra.run.dir={tmp_path / 'run'}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    code, output = run_main(args, monkeypatch, capsys)
    assert code == 1, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(expected), output
    assert not (tmp_path / "sweep" / "0").exists()  # no job of the sweep ran


def test_the_python_api_still_raises_hydras_exception_after_the_command_line_ran(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    run_main([*TINY, "trainer.max_steps=abc", f"hydra.run.dir={tmp_path}"], monkeypatch, capsys)
    with pytest.raises(ConfigCompositionException):
        runner.compose([*TINY, "trainer.max_steps=abc"])


def test_a_wrong_type_through_the_command_line(tmp_path: Path) -> None:
    import subprocess

    result = subprocess.run([sys.executable, "-m", "runner", "trainer.max_steps=abc",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=clean_environ(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: trainer.max_steps=abc is not an integer (trainer.max_steps takes an integer, e.g. "
        "trainer.max_steps=-1)"], result.stderr


# -- the sweep's bookkeeping with concurrent writers ----------------------------------------------------------------

def _write_status_often(job_dir: Path, times: int, errors: "multiprocessing.Queue") -> None:
    from runner import sweep

    try:
        for i in range(times):
            sweep._write_status(job_dir, {"status": "running", "i": i, "pad": "x" * 4000})
        errors.put(None)
    except Exception as error:  # noqa: BLE001 - reported to the test
        errors.put(repr(error))


def test_two_processes_writing_one_jobs_status_never_collide(tmp_path: Path) -> None:
    """submitit with tasks_per_node > 1 runs the sweep's bookkeeping in every task of a job: each writes the job's
    .hydra/job_status.json at once. One shared temporary name had one rename the other's file away
    (FileNotFoundError ... .job_status.json.tmp)."""
    import json
    import multiprocessing

    from runner import sweep

    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    writers = [context.Process(target=_write_status_often, args=(tmp_path, 300, errors)) for _ in range(2)]
    for writer in writers:
        writer.start()
    outcomes = [errors.get(timeout=60) for _ in writers]
    for writer in writers:
        writer.join(timeout=30)
    assert outcomes == [None, None]
    status = json.loads((tmp_path / sweep.STATUS_FILE).read_text())
    assert status["i"] == 299
    assert [p.name for p in (tmp_path / ".hydra").iterdir()] == ["job_status.json"]  # no temporary file left


# -- stage=validate with trainer.limit_val_batches=0 -----------------------------------------------------------------

def test_validate_with_limit_val_batches_0_is_refused_not_run_over_everything(tmp_path: Path) -> None:
    """0 turns validation off (Lightning's meaning): a stage=validate that validated all batches anyway ignored it,
    and one that validated nothing would end as a success without metrics; it is refused in one line."""
    from conftest import compose_config
    from runner.config import ConfigError

    runner.fit(compose_config([*TINY, "trainer.max_steps=2"]), run_dir=tmp_path / "trained")
    last = tmp_path / "trained" / "checkpoints" / "last.ckpt"
    for zero in ("0", "0.0"):
        cfg = compose_config([*TINY, "stage=validate", f"trainer.ckpt_path={last}",
                              f"trainer.limit_val_batches={zero}"])
        with pytest.raises(ConfigError, match=rf"trainer\.limit_val_batches={zero} with stage=validate validates "
                                              r"nothing: 0 turns validation off"):
            runner.fit(cfg, run_dir=tmp_path / f"validate-{zero}")
        assert not (tmp_path / f"validate-{zero}" / "metrics.json").exists()
    validated = runner.fit(compose_config([*TINY, "stage=validate", f"trainer.ckpt_path={last}"]),
                           run_dir=tmp_path / "validate")
    assert "val/loss" in validated


# -- a NaN monitored metric -------------------------------------------------------------------------------------------

class _Loop:
    """What the monitoring callbacks use of the loop: rank 0, the run folder, saves and a stop request."""

    def __init__(self, run_dir: Path) -> None:
        from types import SimpleNamespace

        self.run_dir, self.saved, self.stopped = run_dir, [], None
        self.strategy = SimpleNamespace(is_global_zero=True, reduce_boolean_decision=lambda decision, all: decision)

    def save_checkpoint(self, path: Path) -> None:
        self.saved.append(path.name)

    def remove_checkpoint(self, path: Path) -> None:
        self.saved.remove(path.name)

    def request_stop(self, reason: str) -> None:
        self.stopped = reason


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_model_checkpoint_says_a_non_finite_value_is_no_candidate_and_that_best_was_not_written(
        bad: float, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from runner.callbacks import ModelCheckpoint

    loop, callback = _Loop(tmp_path), ModelCheckpoint(save_top_k=2)
    for step in (20, 40):
        callback.on_validation_end(loop, {"val/loss": bad}, step)
    result: dict = {}
    callback.on_fit_end(loop, result)
    assert loop.saved == [] and "best_model_path" not in result
    assert _warnings(caplog) == [
        f"model_checkpoint: val/loss is {bad} at step 20: not a candidate for best.ckpt",
        f"model_checkpoint: val/loss is {bad} at step 40: not a candidate for best.ckpt",
        f"model_checkpoint: best.ckpt was not written: val/loss was not finite at any of this run's 2 validation(s) "
        f"(last {bad} at step 40)"]


def test_model_checkpoint_keeps_the_finite_best_around_a_nan(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from runner.callbacks import ModelCheckpoint

    loop, callback = _Loop(tmp_path), ModelCheckpoint(save_top_k=2)
    for step, value in ((20, 0.5), (40, float("nan")), (60, 0.4)):
        callback.on_validation_end(loop, {"val/loss": value}, step)
    result: dict = {}
    callback.on_fit_end(loop, result)
    assert (result["best_model_score"], result["best_step"]) == (0.4, 60)
    assert sorted(loop.saved) == ["best-step-000020.ckpt", "best-step-000060.ckpt", "best.ckpt", "best.ckpt"]
    assert _warnings(caplog) == ["model_checkpoint: val/loss is nan at step 40: not a candidate for best.ckpt"]


def test_early_stopping_says_a_nan_counts_as_no_improvement_and_stops_without_crashing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A monitor NaN from the first validation left `best` None, and the stop message formatted it: a TypeError."""
    from runner.callbacks import EarlyStopping

    loop, callback = _Loop(tmp_path), EarlyStopping(patience=2)
    for step in (20, 40):
        callback.on_validation_end(loop, {"val/loss": float("nan")}, step)
    assert loop.stopped == ("early_stopping: val/loss did not improve by more than 0 for 2 validation(s); it was "
                            "never finite")
    assert _warnings(caplog) == [
        "early_stopping: val/loss is nan at step 20: counts as no improvement (1 of patience 2)",
        "early_stopping: val/loss is nan at step 40: counts as no improvement (2 of patience 2)"]
