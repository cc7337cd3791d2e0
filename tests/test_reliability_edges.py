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

