"""Exact resume: 10 steps, then 10 more from last.ckpt, end with the weights of 20 straight steps."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from omegaconf import DictConfig

import runner
from conftest import load_checkpoint
from runner.config import ConfigError

MakeCfg = Callable[..., DictConfig]


def assert_same_weights(a: Path, b: Path) -> None:
    first, second = load_checkpoint(a), load_checkpoint(b)
    assert (first["step"], first["epoch"]) == (second["step"], second["epoch"])
    assert first["model"].keys() == second["model"].keys()
    for name, tensor in second["model"].items():
        torch.testing.assert_close(first["model"][name], tensor, rtol=0, atol=1e-6, msg=f"model.{name} differs")
    assert first["optimizer"]["param_groups"][0]["lr"] == pytest.approx(second["optimizer"]["param_groups"][0]["lr"])


@pytest.mark.parametrize("overrides", [
    # 160 samples / batch 16: 10 steps per epoch, so the stop falls on an epoch boundary.
    ("data.num_samples=160", "optimizer=sgd"),
    # 256 / 16: 16 steps per epoch, so the stop falls mid-epoch and the resumed epoch must skip 10 batches.
    ("data.num_samples=256", "optimizer=sgd", "optimizer.momentum=0.9"),
    # Optimizer state (Adam moments) and a scheduler whose rate changes every step, mid-epoch.
    ("data.num_samples=256", "optimizer=adamw", "scheduler=cosine", "+scheduler.total_steps=20"),
], ids=["epoch-boundary", "mid-epoch", "adamw-cosine"])
def test_resume_equals_straight_run(make_cfg: MakeCfg, tmp_path: Path, overrides: tuple[str, ...]) -> None:
    runner.fit(make_cfg(*overrides, "trainer.max_steps=20"), run_dir=tmp_path / "straight")
    first = runner.fit(make_cfg(*overrides, "trainer.max_steps=10"), run_dir=tmp_path / "first")
    assert first["step"] == 10
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    resumed = runner.fit(make_cfg(*overrides, "trainer.max_steps=20", f"trainer.ckpt_path={last}"),
                         run_dir=tmp_path / "resumed")
    assert resumed["step"] == 20
    assert_same_weights(tmp_path / "resumed", tmp_path / "straight")


def test_ckpt_path_last_resumes_the_run_folders_own_checkpoint(make_cfg: MakeCfg, tmp_path: Path) -> None:
    runner.fit(make_cfg("trainer.max_steps=20"), run_dir=tmp_path / "straight")
    run = tmp_path / "run"
    runner.fit(make_cfg("trainer.max_steps=10"), run_dir=run)
    metrics = runner.fit(make_cfg("trainer.max_steps=20", "trainer.ckpt_path=last"), run_dir=run)
    assert metrics["step"] == 20
    assert f"resuming from {run / 'checkpoints' / 'last.ckpt'}" in (run / "runner.log").read_text()
    assert_same_weights(run, tmp_path / "straight")


def test_ckpt_path_last_falls_back_to_the_newest_run_under_outputs(make_cfg: MakeCfg, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    earlier = tmp_path / "outputs" / "2030-01-01" / "00-00-00"
    runner.fit(make_cfg("trainer.max_steps=10"), run_dir=earlier)
    metrics = runner.fit(make_cfg("trainer.max_steps=12", "trainer.ckpt_path=last"),
                         run_dir=tmp_path / "outputs" / "2030-01-01" / "00-00-01")
    assert metrics["step"] == 12
    assert load_checkpoint(earlier)["step"] == 10  # the earlier run's checkpoint is read, not rewritten


def test_ckpt_path_last_without_any_checkpoint_starts_fresh(make_cfg: MakeCfg, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no outputs/ folder here
    metrics = runner.fit(make_cfg("trainer.ckpt_path=last"), run_dir=tmp_path / "run")
    assert metrics["step"] == 3


def test_resume_mid_epoch_with_a_batch_that_does_not_divide_the_position(make_cfg: MakeCfg, tmp_path: Path) -> None:
    runner.fit(make_cfg("trainer.max_steps=5"), run_dir=tmp_path / "first")  # 5 x 16 = 80 samples into the epoch
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    cfg = make_cfg("data.batch_size=48", "trainer.max_steps=8", f"trainer.ckpt_path={last}")
    with pytest.raises(ConfigError, match="stopped 80 samples into an epoch, .* = 48"):
        runner.fit(cfg, run_dir=tmp_path / "resumed")


def test_resume_with_more_accumulation_than_the_position_allows_is_refused(make_cfg: MakeCfg,
                                                                           tmp_path: Path) -> None:
    runner.fit(make_cfg("trainer.max_steps=5"), run_dir=tmp_path / "first")  # 5 batches of 16 into the epoch
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    # Batches of 16 still divide 80 samples, but steps of 2 x 16 do not: the first step would take half a batch.
    cfg = make_cfg("trainer.accumulate_grad_batches=2", "trainer.max_steps=8", f"trainer.ckpt_path={last}")
    with pytest.raises(ConfigError, match=r"stopped 80 samples into an epoch, .*accumulate_grad_batches = 32\); "
                                          r"resume with its global batch \(16\)"):
        runner.fit(cfg, run_dir=tmp_path / "resumed")
    assert not (tmp_path / "resumed" / "checkpoints").exists()


def test_resume_with_another_global_batch_that_divides_the_position_continues_and_warns(
        make_cfg: MakeCfg, tmp_path: Path) -> None:
    runner.fit(make_cfg("trainer.max_steps=4"), run_dir=tmp_path / "first")  # 64 samples into the epoch
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    metrics = runner.fit(make_cfg("trainer.accumulate_grad_batches=2", "trainer.max_steps=6",
                                  f"trainer.ckpt_path={last}"), run_dir=tmp_path / "resumed")
    assert metrics["step"] == 6
    checkpoint = load_checkpoint(tmp_path / "resumed")
    assert checkpoint["samples_in_epoch"] == 64 + 2 * 32 and checkpoint["global_batch_size"] == 32
    assert "trained with a global batch of 16 with one of 32" in (tmp_path / "resumed" / "runner.log").read_text()


def test_resuming_into_another_model_is_refused_before_training(make_cfg: MakeCfg, tmp_path: Path) -> None:
    runner.fit(make_cfg("trainer.max_steps=2"), run_dir=tmp_path / "first")
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    cfg = make_cfg("model.hidden=7", "trainer.max_steps=4", f"trainer.ckpt_path={last}")
    with pytest.raises(ConfigError, match=r"holds another model than model=runner.models.MLP: shapes"):
        runner.fit(cfg, run_dir=tmp_path / "resumed")
    assert not (tmp_path / "resumed" / "checkpoints").exists()


def test_ckpt_path_last_skips_runs_of_another_model(make_cfg: MakeCfg, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    runner.fit(make_cfg("trainer.max_steps=2", "model.hidden=7"), run_dir=tmp_path / "outputs" / "a" / "other")
    result = runner.fit(make_cfg("trainer.max_steps=2", "trainer.ckpt_path=last"), run_dir=tmp_path / "outputs" / "b" / "new")
    assert result["step"] == 2  # trained from the start: the only last.ckpt belongs to another model
    assert "resuming" not in (tmp_path / "outputs" / "b" / "new" / "runner.log").read_text()


def test_resume_with_a_new_lr_follows_it_and_says_so(make_cfg: MakeCfg, tmp_path: Path) -> None:
    run = tmp_path / "run"
    runner.fit(make_cfg("optimizer=sgd", "optimizer.lr=0.1", "scheduler=linear", "+scheduler.total_steps=20",
                        "trainer.max_steps=10"), run_dir=run)
    assert load_checkpoint(run)["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.05)  # half-way down
    metrics = runner.fit(make_cfg("optimizer=sgd", "optimizer.lr=0.01", "optimizer.momentum=0.5", "scheduler=linear",
                                  "+scheduler.total_steps=20", "trainer.max_steps=12", "trainer.ckpt_path=last"),
                         run_dir=run)
    # The schedule carries on from step 10 of 20, scaled to the new rate: step 12 trains at 0.01 x (1 - 11/20).
    assert metrics["lr"] == pytest.approx(0.01 * 9 / 20)
    group = load_checkpoint(run)["optimizer"]["param_groups"][0]
    assert group["momentum"] == 0.5 and group["initial_lr"] == pytest.approx(0.01)
    log = (run / "runner.log").read_text()
    assert "resumed with this run's optimizer settings, not the checkpoint's: lr 0.1 -> 0.01; momentum 0.9 -> 0.5" in log


def test_resuming_with_another_optimizer_is_refused_with_a_message(make_cfg: MakeCfg, tmp_path: Path) -> None:
    run = tmp_path / "run"
    runner.fit(make_cfg("optimizer=sgd", "trainer.max_steps=4"), run_dir=run)
    before = (run / "checkpoints" / "last.ckpt").read_bytes()
    with pytest.raises(ConfigError, match=r"holds the state of another optimizer: optimizer=torch\.optim\.AdamW .*"
                                          r"momentum_buffer; resume with the optimizer it was saved with"):
        runner.fit(make_cfg("optimizer=adamw", "trainer.max_steps=8", "trainer.ckpt_path=last"), run_dir=run)
    assert (run / "checkpoints" / "last.ckpt").read_bytes() == before  # nothing lost
