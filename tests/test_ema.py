"""`callbacks=ema`: the average against a hand computation over a few steps (1 and 2 DDP processes), validation
on it, the trained weights kept in checkpoints, an exact resume, float32 for 16-bit weights, and what it refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from omegaconf import DictConfig

import runner
from conftest import load_checkpoint, read_events, val_loss_of
from runner.checks import validate
from runner.config import ConfigError

MakeCfg = Callable[..., DictConfig]
EMA = ("callbacks=[ema,model_checkpoint]", "callbacks.ema.decay=0.5", "callbacks.ema.every_n_steps=2",
       "trainer.max_steps=4", "trainer.ckpt_every_n_steps=1", "trainer.val_check_interval=2", "optimizer.lr=0.05")


def saved(run_dir: Path, step: int) -> tuple[dict, dict]:
    """A step-N checkpoint's (model weights, EMA weights)."""
    checkpoint = load_checkpoint(run_dir, f"step-{step:06d}.ckpt")
    return checkpoint["model"], checkpoint["callbacks"]["ema"]["weights"]


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("devices", [1, 2], ids=["1-process", "2-processes"])
def test_the_average_is_the_hand_computed_one_and_validation_runs_on_it(make_cfg: MakeCfg, tmp_path: Path,
                                                                        devices: int) -> None:
    ddp = ("strategy=ddp", "trainer.devices=2") if devices == 2 else ()
    cfg = make_cfg(*EMA, *ddp, f"data.batch_size={16 // devices}")
    runner.fit(cfg, run_dir=tmp_path / "ema")
    (_, e1), (w2, e2), (_, e3), (w4, e4) = (saved(tmp_path / "ema", step) for step in range(1, 5))
    for name in e1:  # every_n_steps=2: updated after steps 2 and 4 only, with decay 0.5
        assert torch.allclose(e2[name], 0.5 * e1[name] + 0.5 * w2[name], rtol=0, atol=1e-7)
        assert torch.equal(e3[name], e2[name])
        assert torch.allclose(e4[name], 0.5 * e2[name] + 0.5 * w4[name], rtol=0, atol=1e-7)
    assert any(not torch.allclose(e4[name], w4[name]) for name in e4)
    val = {event.step: event.value for event in read_events(tmp_path / "ema").Scalars("val/loss")}
    assert val[2] == pytest.approx(val_loss_of(cfg, {**w2, **e2}), rel=1e-5)  # validated on the average
    assert val[4] == pytest.approx(val_loss_of(cfg, {**w4, **e4}), rel=1e-5)
    assert val[4] != pytest.approx(val_loss_of(cfg, w4), rel=1e-5)
    best = load_checkpoint(tmp_path / "ema", "best.ckpt")  # saved at validation: the trained weights, not the average
    assert_equal(best["model"], saved(tmp_path / "ema", best["step"])[0])
    if devices == 1:  # swapping the average in and out leaves training exactly as without it
        plain = (o for o in EMA if not o.startswith("callbacks"))
        runner.fit(make_cfg(*plain, "callbacks=none", f"data.batch_size={16 // devices}"), run_dir=tmp_path / "raw")
        assert_equal(load_checkpoint(tmp_path / "raw")["model"], load_checkpoint(tmp_path / "ema")["model"])


def test_a_resumed_run_ends_with_the_average_of_an_uninterrupted_one(make_cfg: MakeCfg, tmp_path: Path) -> None:
    common = ("callbacks=ema", "callbacks.ema.decay=0.9", "trainer.val_check_interval=2", "optimizer.lr=0.05")
    runner.fit(make_cfg(*common, "trainer.max_steps=6"), run_dir=tmp_path / "whole")
    runner.fit(make_cfg(*common, "trainer.max_steps=3"), run_dir=tmp_path / "parts")
    runner.fit(make_cfg(*common, "trainer.max_steps=6", "trainer.ckpt_path=last"), run_dir=tmp_path / "parts")
    whole, parts = load_checkpoint(tmp_path / "whole"), load_checkpoint(tmp_path / "parts")
    assert whole["step"] == parts["step"] == 6
    assert_equal(whole["callbacks"]["ema"]["weights"], parts["callbacks"]["ema"]["weights"])
    assert_equal(whole["model"], parts["model"])


def test_sixteen_bit_weights_are_averaged_in_float32(make_cfg: MakeCfg, tmp_path: Path) -> None:
    runner.fit(make_cfg("callbacks=ema", "callbacks.ema.decay=0.999", "precision=bf16-true"), run_dir=tmp_path)
    checkpoint = load_checkpoint(tmp_path)
    weights = checkpoint["callbacks"]["ema"]["weights"]
    assert {w.dtype for w in weights.values()} == {torch.float32}
    assert {checkpoint["model"][name].dtype for name in weights} == {torch.bfloat16}
    # 0.1% of a step's change per step is below bfloat16's resolution: kept in bfloat16 it would not move
    assert any(not torch.equal(w, checkpoint["model"][name].float()) for name, w in weights.items())


@pytest.mark.parametrize(("setting", "message"), [
    ("callbacks.ema.decay=1.5", r"callbacks\.ema\.decay=1\.5 must be a number between 0 and 1"),
    ("callbacks.ema.every_n_steps=0", r"callbacks\.ema\.every_n_steps=0 must be a positive number of steps"),
])
def test_bad_settings_are_refused_before_the_run(make_cfg: MakeCfg, setting: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg("callbacks=ema", setting))


def test_fsdp_is_refused_with_a_clear_message(make_cfg: MakeCfg, tmp_path: Path) -> None:
    cfg = make_cfg("callbacks=ema", "strategy=fsdp", "trainer.devices=2")
    with pytest.raises(Exception, match=r"callbacks\.ema is not available with strategy=fsdp.*use strategy=ddp"):
        runner.fit(cfg, run_dir=tmp_path)


def test_fsdp_is_refused_before_any_worker_starts(make_cfg: MakeCfg) -> None:
    with pytest.raises(ConfigError, match=r"- callbacks\.ema is not available with strategy=fsdp.*use strategy=ddp"):
        validate(make_cfg("callbacks=ema", "strategy=fsdp", "trainer.devices=2"))
