"""A resume and its schedule: another scheduler is refused in one line, trainer.resume=new_schedule starts the
configured one (warm-up included) from the checkpoint's step, trainer.resume=weights starts from its weights alone."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable

import pytest
import torch
from omegaconf import DictConfig

import runner
from conftest import load_checkpoint, read_events
from runner.checkpoint_io import TorchCheckpointIO
from runner.checkpoint_io.torch_io import CHECKSUM_KEY
from runner.config import ConfigError

MakeCfg = Callable[..., DictConfig]


def first_run(make_cfg: MakeCfg, tmp_path: Path, *overrides: str) -> Path:
    """4 steps of SGD at lr 0.1 (the scheduler `overrides` name), and the path of its last.ckpt."""
    runner.fit(make_cfg("optimizer=sgd", "optimizer.lr=0.1", "trainer.max_steps=4", *overrides),
               run_dir=tmp_path / "first")
    return tmp_path / "first" / "checkpoints" / "last.ckpt"


def logged_lrs(run_dir: Path) -> dict[int, float]:
    """The `lr` logged at each step: the rate the next step trains with (after the step's scheduler step)."""
    return {event.step: event.value for event in read_events(run_dir).Scalars("lr")}


@pytest.mark.parametrize(("before", "after", "names"), [
    ("scheduler=cosine", "scheduler=constant", r"scheduler cosine \(min_lr_ratio=0\.0\), this run configures "
                                               r"ConstantLR \(factor=1\.0, total_iters=0\)"),
    ("scheduler=constant", "scheduler=warmup_cosine", r"scheduler ConstantLR \(factor=1\.0, total_iters=0\), this "
                                                      r"run configures warmup_cosine \(min_lr_ratio=0\.0, "
                                                      r"warmup_steps=100\)"),
], ids=["cosine-to-constant", "constant-to-warmup_cosine"])
def test_an_exact_resume_with_another_scheduler_is_refused_in_one_line(make_cfg: MakeCfg, tmp_path: Path,
                                                                       before: str, after: str, names: str) -> None:
    last = first_run(make_cfg, tmp_path, before)
    with pytest.raises(ConfigError) as refused:
        runner.fit(make_cfg("optimizer=sgd", "trainer.max_steps=8", after, f"trainer.ckpt_path={last}"),
                   run_dir=tmp_path / "resumed")
    (line,) = refused.value.problems
    assert "\n" not in line
    assert re.search(names + r"; resume with the scheduler it was trained with, or set "
                     r"trainer\.resume=new_schedule to start this one at step 4", line), line
    assert not (tmp_path / "resumed" / "checkpoints").exists()  # refused before anything trained


def test_an_exact_resume_with_another_warmup_is_refused(make_cfg: MakeCfg, tmp_path: Path) -> None:
    last = first_run(make_cfg, tmp_path, "scheduler=warmup_cosine", "scheduler.warmup_steps=2")
    with pytest.raises(ConfigError, match=r"warmup_cosine \(min_lr_ratio=0\.0, warmup_steps=2\), this run configures "
                                          r"warmup_cosine \(min_lr_ratio=0\.0, warmup_steps=5\)"):
        runner.fit(make_cfg("optimizer=sgd", "scheduler=warmup_cosine", "scheduler.warmup_steps=5",
                            "trainer.max_steps=8", f"trainer.ckpt_path={last}"), run_dir=tmp_path / "resumed")


def test_an_older_checkpoint_of_another_scheduler_is_one_line_not_a_key_error(make_cfg: MakeCfg,
                                                                              tmp_path: Path) -> None:
    last = first_run(make_cfg, tmp_path, "scheduler=constant")
    older = load_checkpoint(tmp_path / "first")
    del older["schedule"], older["run_dir"], older[CHECKSUM_KEY]  # a checkpoint saved before the record
    TorchCheckpointIO().save_checkpoint(older, tmp_path / "older.ckpt")
    with pytest.raises(ConfigError) as refused:
        runner.fit(make_cfg("optimizer=sgd", "scheduler=cosine", "trainer.max_steps=8",
                            f"trainer.ckpt_path={tmp_path / 'older.ckpt'}"), run_dir=tmp_path / "resumed")
    (line,) = refused.value.problems
    assert "holds the state of another scheduler" in line and "trainer.resume=new_schedule" in line, line
    assert last.exists()


def test_a_new_schedule_starts_the_configured_one_at_the_checkpoints_step(make_cfg: MakeCfg, tmp_path: Path) -> None:
    last = first_run(make_cfg, tmp_path, "scheduler=cosine")  # ends at lr 0
    resumed = tmp_path / "resumed"
    metrics = runner.fit(make_cfg("optimizer=sgd", "optimizer.lr=0.01", "scheduler=linear",
                                  "scheduler.warmup_steps=2", "scheduler.end_lr_ratio=0.2", "trainer.max_steps=8",
                                  "trainer.resume=new_schedule", f"trainer.ckpt_path={last}"), run_dir=resumed)
    assert metrics["step"] == 8
    # Linear over the 4 steps left: warm-up (k + 1) / 2 for k < 2, then 1 - 0.8 (k - 2) / 2 from the new lr 0.01.
    factor = [0.5, 1.0, 1.0, 0.6, 0.2]  # k = 0 .. 4: steps 5 .. 8 train with k = 0 .. 3
    assert logged_lrs(resumed) == pytest.approx({4 + k: 0.01 * factor[k - 1] for k in range(1, 5)})
    log = (resumed / "runner.log").read_text()
    assert ("trainer.resume=new_schedule: a new schedule from step 4: linear (end_lr_ratio=0.2, warmup_steps=2) "
            "over the remaining 4 steps, lr 0.01") in log
    # Its own checkpoint resumes it exactly: same schedule, from where it stopped, to a later end.
    again = runner.fit(make_cfg("optimizer=sgd", "optimizer.lr=0.01", "scheduler=linear", "scheduler.warmup_steps=2",
                                "scheduler.end_lr_ratio=0.2", "trainer.max_steps=8", "trainer.resume=new_schedule",
                                "trainer.ckpt_path=last"), run_dir=resumed)
    assert again["step"] == 8
    assert "is this run folder's own" in (resumed / "runner.log").read_text()
    assert load_checkpoint(resumed)["schedule"] == {"scheduler": {
        "_target_": "runner.schedulers.linear", "end_lr_ratio": 0.2, "warmup_steps": 2}, "start": 4, "total_steps": 4}


def test_a_warmup_on_resume_takes_effect_under_a_new_schedule(make_cfg: MakeCfg, tmp_path: Path) -> None:
    last = first_run(make_cfg, tmp_path, "scheduler=warmup_cosine", "scheduler.warmup_steps=2")
    resumed = tmp_path / "resumed"
    runner.fit(make_cfg("optimizer=sgd", "optimizer.lr=0.1", "scheduler=warmup_cosine", "scheduler.warmup_steps=4",
                        "trainer.max_steps=10", "trainer.resume=new_schedule", f"trainer.ckpt_path={last}"),
               run_dir=resumed)
    # Warm-up over 4 of the 6 steps left, then a half cosine over 2; step 4 + k trains with factor[k - 1].
    factor = [0.25, 0.5, 0.75, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 2)), 0.0]
    assert logged_lrs(resumed) == pytest.approx({4 + k: 0.1 * factor[k - 1] for k in range(1, 7)}, rel=1e-6,
                                                abs=1e-9)


def test_a_longer_exact_resume_says_its_schedule_is_replanned(make_cfg: MakeCfg, tmp_path: Path) -> None:
    last = first_run(make_cfg, tmp_path, "scheduler=cosine")
    resumed = tmp_path / "resumed"
    runner.fit(make_cfg("optimizer=sgd", "optimizer.lr=0.1", "scheduler=cosine", "trainer.max_steps=8",
                        f"trainer.ckpt_path={last}"), run_dir=resumed)
    assert ("trainer.max_steps: the checkpoint's cosine (min_lr_ratio=0.0) was planned over 4 optimizer steps (to "
            "step 4), this run ends at step 8") in (resumed / "runner.log").read_text()
    assert logged_lrs(resumed)[6] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 5 / 8)))  # step 6's rate


def test_weights_alone_start_a_new_run_from_step_0(make_cfg: MakeCfg, tmp_path: Path) -> None:
    runner.fit(make_cfg("optimizer=adamw", "scheduler=cosine", "trainer.max_steps=6"), run_dir=tmp_path / "first")
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    started = tmp_path / "started"
    # A tiny rate: one AdamW step moves each weight by about 1e-9, so the run keeps the weights it started from.
    metrics = runner.fit(make_cfg("optimizer=adamw", "optimizer.lr=1e-9", "scheduler=constant", "trainer.max_steps=1",
                                  "trainer.resume=weights", f"trainer.ckpt_path={last}"), run_dir=started)
    assert metrics["step"] == 1
    by_hand, fresh = load_checkpoint(tmp_path / "first")["model"], load_checkpoint(started)
    for name, tensor in fresh["model"].items():
        torch.testing.assert_close(tensor, by_hand[name], rtol=0, atol=1e-6, msg=f"model.{name}")
    steps = {int(s["step"]) for s in fresh["optimizer"]["state"].values()}
    assert steps == {1}  # a new optimizer: its first step, not the checkpoint's seventh
    assert fresh["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-9)
    assert "trainer.resume=weights: the model's weights of" in (started / "runner.log").read_text()
    # Without them, the same run starts from its own initial weights.
    runner.fit(make_cfg("optimizer=adamw", "optimizer.lr=1e-9", "scheduler=constant", "trainer.max_steps=1"),
               run_dir=tmp_path / "plain")
    plain = load_checkpoint(tmp_path / "plain")["model"]
    assert any((plain[name] - tensor).abs().max() > 1e-3 for name, tensor in by_hand.items())


def test_resume_takes_exact_new_schedule_or_weights(make_cfg: MakeCfg, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer.resume=fresh is not allowed: use exact"):
        runner.fit(make_cfg("trainer.resume=fresh", "trainer.ckpt_path=x.ckpt"), run_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match=r"trainer.resume=weights takes a checkpoint: set trainer.ckpt_path"):
        runner.fit(make_cfg("trainer.resume=weights"), run_dir=tmp_path / "b")
