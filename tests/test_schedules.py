"""Schedules without arithmetic: schedulers decay over the steps the run takes, on any number of processes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import pytest
import torch
from omegaconf import DictConfig

import runner
from conftest import load_checkpoint, read_events
from runner.config import ConfigError
from runner.schedulers import cosine, linear, warmup_cosine

MakeCfg = Callable[..., DictConfig]
LR = 0.1


def lrs(run_dir: Path) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in read_events(run_dir).Scalars("lr")]


def factors(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    values = []
    for _ in range(steps):
        values.append(scheduler.get_last_lr()[0] / LR)
        scheduler.optimizer.step()
        scheduler.step()
    return values + [scheduler.get_last_lr()[0] / LR]


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)


def test_the_schedules_start_and_end_where_they_say() -> None:
    assert factors(cosine(optimizer(), 4), 4) == pytest.approx([1, (1 + math.cos(math.pi / 4)) / 2, 0.5,
                                                               (1 + math.cos(3 * math.pi / 4)) / 2, 0], abs=1e-9)
    assert factors(warmup_cosine(optimizer(), 6, warmup_steps=2, min_lr_ratio=0.1), 6)[:3] == pytest.approx(
        [0.5, 1.0, 1.0])
    assert factors(warmup_cosine(optimizer(), 6, warmup_steps=2, min_lr_ratio=0.1), 6)[-1] == pytest.approx(0.1)
    assert factors(linear(optimizer(), 4, end_lr_ratio=0.2), 4) == pytest.approx([1, 0.8, 0.6, 0.4, 0.2])


@pytest.mark.parametrize("devices", [1, 2], ids=["1-process", "2-processes"])
def test_cosine_ends_at_its_minimum_whatever_the_number_of_processes(make_cfg: MakeCfg, tmp_path: Path,
                                                                     devices: int) -> None:
    # 2 epochs of 256 samples at 16 per process: 32 steps on 1 process, 16 on 2; no step count in the config.
    ddp = ("strategy=ddp", "trainer.devices=2") if devices == 2 else ()
    cfg = make_cfg(*ddp, "scheduler=cosine", "optimizer=sgd", f"optimizer.lr={LR}", "trainer.max_steps=-1",
                   "trainer.max_epochs=2", "trainer.log_every_n_steps=1")
    metrics = runner.fit(cfg, run_dir=tmp_path)
    steps = 32 // devices
    assert metrics["step"] == steps
    logged = lrs(tmp_path)
    assert [step for step, _ in logged] == list(range(1, steps + 1))
    # Each step logs the rate it trained with: step s at LR x (1 + cos(pi (s - 1) / steps)) / 2, half way half of it.
    assert logged[-1][1] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * (steps - 1) / steps)), rel=1e-5)
    assert logged[steps // 2][1] == pytest.approx(LR / 2, rel=1e-5)
    last_rate = load_checkpoint(tmp_path)["optimizer"]["param_groups"][0]["lr"]
    assert last_rate == pytest.approx(0.0, abs=1e-9)  # the last step's scheduler step reaches the minimum


def test_warmup_cosine_warms_up_then_ends_at_its_floor(make_cfg: MakeCfg, tmp_path: Path) -> None:
    cfg = make_cfg("scheduler=warmup_cosine", "scheduler.warmup_steps=4", "scheduler.min_lr_ratio=0.1",
                   "optimizer=sgd", f"optimizer.lr={LR}", "trainer.max_steps=12")
    runner.fit(cfg, run_dir=tmp_path)
    values = [value for _, value in lrs(tmp_path)]  # the rate each step trained with
    assert values[:5] == pytest.approx([LR / 4, LR / 2, LR * 3 / 4, LR, LR])
    assert load_checkpoint(tmp_path)["optimizer"]["param_groups"][0]["lr"] == pytest.approx(LR * 0.1)  # then


def test_max_steps_alone_decides_and_says_so(make_cfg: MakeCfg, tmp_path: Path) -> None:
    cfg = make_cfg("trainer.max_steps=100", "trainer.max_epochs=null", "scheduler=linear", "trainer.log_every_n_steps=50")
    metrics = runner.fit(cfg, run_dir=tmp_path)
    assert metrics["step"] == 100 and metrics["epoch"] == 6  # 16 steps an epoch: past the default 5 epochs
    assert load_checkpoint(tmp_path)["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert "trainer.max_steps=100 decides the length" in (tmp_path / "runner.log").read_text()


def test_a_total_steps_in_the_config_wins(make_cfg: MakeCfg, tmp_path: Path) -> None:
    cfg = make_cfg("scheduler=linear", "+scheduler.total_steps=6", "optimizer=sgd", f"optimizer.lr={LR}",
                   "trainer.max_steps=3")
    assert runner.fit(cfg, run_dir=tmp_path)["lr"] == pytest.approx(LR * 4 / 6)  # step 3's rate, 2 steps down
    assert load_checkpoint(tmp_path)["optimizer"]["param_groups"][0]["lr"] == pytest.approx(LR / 2)


@pytest.mark.parametrize(("overrides", "message"), [
    (("scheduler=warmup_cosine", "scheduler.warmup_steps=-1"), r"scheduler\.warmup_steps=-1 must be 0 or a positive"),
    (("scheduler=linear", "scheduler.end_lr_ratio=2"), r"scheduler\.end_lr_ratio=2 must be a fraction"),
])
def test_bad_schedule_settings_name_the_key(make_cfg: MakeCfg, tmp_path: Path, overrides: tuple, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        runner.fit(make_cfg(*overrides), run_dir=tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_a_warm_up_as_long_as_the_run_is_named_in_the_log(make_cfg: MakeCfg, tmp_path: Path) -> None:
    """The default 100 warm-up steps in a 6-step run never reach the decay: a warning, since smoke tests are short."""
    runner.fit(make_cfg("scheduler=warmup_cosine", "trainer.max_steps=6"), run_dir=tmp_path)
    assert ("scheduler.warmup_steps=100 is not below this run's 6 optimizer steps (scheduler.total_steps): the rate "
            "rises for the whole run and never decays") in (tmp_path / "runner.log").read_text()
