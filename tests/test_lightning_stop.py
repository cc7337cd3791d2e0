"""`trainer.should_stop` under DDP: set on every process, the run stops at that step, as Lightning and one process
stop; set on some processes only, every process stops after the next step (the processes vote without waiting for
one another at every step), none hangs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import runner
from conftest import TINY, load_checkpoint

TESTS = Path(__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "stopped_at"), [("[0,1]", 4), ("[1]", 5)], ids=["every-process", "rank-1-only"])
def test_should_stop_under_ddp_stops_every_process_at_one_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               ranks: str, stopped_at: int) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the workers import the module
    cfg = runner.compose([*TINY, "model._target_=lightning_stop_modules.StopOnRanks", "+model.stop_at=4",
                          f"+model.ranks={ranks}", "trainer.max_steps=10", "strategy=ddp", "trainer.devices=2"])
    metrics = runner.fit(cfg, run_dir=tmp_path)
    assert metrics["step"] == stopped_at and metrics["stopped_early"] is True
    assert load_checkpoint(tmp_path)["step"] == stopped_at
    assert json.loads((tmp_path / "metrics.json").read_text())["step"] == stopped_at
