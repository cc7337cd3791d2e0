"""A symbolic link planted where a run writes a file is never written through: the run's lock, its resolved config
and Hydra's records are written in the link's place (as metrics and checkpoints are), and the file the link points
to keeps its content, in a fresh run, on resume and in a sweep's job. `runner.cli.main` runs in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY, run_main

BASE = [*(o for o in TINY if not o.startswith("logger.")), "logger=none", "trainer.max_steps=1"]
# Every file of .hydra/ a job writes: the runner's lock and resolved config, Hydra's three records.
RECORDS = ("run.lock", "resolved.yaml", "config.yaml", "hydra.yaml", "overrides.yaml")


def _plant(folder: Path, target: Path) -> None:
    (folder / ".hydra").mkdir(parents=True, exist_ok=True)
    for name in RECORDS:
        (folder / ".hydra" / name).unlink(missing_ok=True)
        (folder / ".hydra" / name).symlink_to(target)


def _written_in_place(folder: Path) -> None:
    for name in RECORDS[1:]:  # the lock is removed as the run ends
        path = folder / ".hydra" / name
        assert not path.is_symlink() and path.stat().st_size > 0, name
    assert not (folder / ".hydra" / "run.lock").is_symlink()


def test_links_at_the_runs_records_are_replaced_in_a_run_on_resume_and_in_a_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("precious\n")
    run = tmp_path / "run"
    _plant(run, target)
    code, output = run_main([*BASE, f"hydra.run.dir={run}"], monkeypatch, capsys)
    assert code == 0, output
    assert target.read_text() == "precious\n"
    _written_in_place(run)

    _plant(run, target)
    code, output = run_main([*BASE, "trainer.max_steps=2", "trainer.ckpt_path=last", f"hydra.run.dir={run}"],
                            monkeypatch, capsys)
    assert code == 0, output
    assert "resuming from" in output and target.read_text() == "precious\n"
    _written_in_place(run)

    sweep = tmp_path / "sweep"
    _plant(sweep / "0", target)
    (sweep / "multirun.yaml").symlink_to(target)
    code, output = run_main(["-m", *BASE, "optimizer.lr=0.1", f"hydra.sweep.dir={sweep}"], monkeypatch, capsys)
    assert code == 0, output
    assert target.read_text() == "precious\n"
    _written_in_place(sweep / "0")
    assert not (sweep / "multirun.yaml").is_symlink()


def test_a_hydra_folder_that_is_a_link_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.yaml").write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".hydra").symlink_to(elsewhere)
    code, output = run_main([*BASE, f"hydra.run.dir={run}"], monkeypatch, capsys)
    assert code == 1, output
    assert (f"{run / '.hydra'} is a symbolic link (to {elsewhere}); the runner never writes its records through a "
            "link: remove it, or choose another hydra.run.dir") in output, output
    assert "Traceback" not in output
    assert sorted(p.name for p in elsewhere.iterdir()) == ["config.yaml"]
    assert (elsewhere / "config.yaml").read_text() == "precious\n"
