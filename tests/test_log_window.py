"""The train log window: `train/*` averages the steps since the previous log step (trainer.log_every_n_steps),
whatever the checkpoints; a checkpoint carries the open window, so a run resumed from it logs what an
uninterrupted run logs. And `lr/<group>` for each param group."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from statistics import fmean
from typing import Callable

import pytest
import torch
from omegaconf import DictConfig

import runner
from conftest import load_checkpoint, read_events
from runner.checkpoint_io import TorchCheckpointIO
from runner.checkpoint_io.torch_io import CHECKSUM_KEY
from runner.models import MLP

MakeCfg = Callable[..., DictConfig]

# 20 steps of batch 16 over 256 samples (16 steps an epoch), a log every 5 steps: windows 1-5, 6-10, 11-15, 16-20.
WINDOW = ("trainer.max_steps=20", "trainer.log_every_n_steps=5", "optimizer=sgd",
          f"+logger.recorder._target_={__name__}.Recorder")


class Recorder:
    """A logger that keeps every (step, metrics) it is given, by run folder."""

    logged: dict[str, list[tuple[int, dict]]] = {}

    def __init__(self, root_dir: str) -> None:
        self.records = Recorder.logged[str(root_dir)] = []

    def log_metrics(self, metrics, step):
        self.records.append((step, dict(metrics)))

    def resume_at(self, step):
        pass

    def log_hyperparams(self, params, metrics):
        pass

    def finalize(self):
        pass


class SignalAt(MLP):
    """runner.models.MLP that sends its own process SIGTERM in its `signal_at`-th training forward pass."""

    def __init__(self, signal_at: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.signal_at, self.calls = signal_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.device.type != "meta":
            self.calls += 1
            if self.calls == self.signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
        return super().forward(x)


class TwoGroupSGD(torch.optim.SGD):
    """SGD with the weights in a group named `weights` at `lr` and the biases in an unnamed one at lr / 10."""

    def __init__(self, params, lr: float, **settings) -> None:
        params = list(params)
        super().__init__([{"params": [p for p in params if p.dim() > 1], "name": "weights"},
                          {"params": [p for p in params if p.dim() == 1], "lr": lr / 10}], lr=lr, **settings)


def logged(run_dir: Path, tag: str = "train/loss") -> dict[int, float]:
    return {step: metrics[tag] for step, metrics in Recorder.logged[str(run_dir)] if tag in metrics}


def final(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def step_losses(make_cfg: MakeCfg, run_dir: Path) -> dict[int, float]:
    """Each step's own train/loss (a log every step): what the windows average by hand."""
    runner.fit(make_cfg(*WINDOW, "trainer.log_every_n_steps=1"), run_dir=run_dir)
    return logged(run_dir)


def window_means(losses: dict[int, float], ends: list[int], log_every: int = 5) -> dict[int, float]:
    """The mean loss of the steps since the previous log step (every batch holds 16 samples: a plain mean)."""
    return {end: fmean(losses[step] for step in range(end - (end - 1) % log_every, end + 1)) for end in ends}


def test_checkpoints_off_the_log_grid_change_nothing_that_is_logged(make_cfg: MakeCfg, tmp_path: Path) -> None:
    losses = step_losses(make_cfg, tmp_path / "each")
    runner.fit(make_cfg(*WINDOW), run_dir=tmp_path / "plain")
    runner.fit(make_cfg(*WINDOW, "trainer.ckpt_every_n_steps=3"), run_dir=tmp_path / "saving")
    expected = window_means(losses, [5, 10, 15, 20])
    for run in ("plain", "saving"):
        assert list(logged(tmp_path / run)) == [5, 10, 15, 20], run  # no point at a checkpoint's step
        assert logged(tmp_path / run) == pytest.approx(expected, rel=1e-9), run
        assert final(tmp_path / run)["train/loss"] == pytest.approx(fmean(losses[s] for s in range(16, 21)),
                                                                   rel=1e-9)
    assert sorted(p.name for p in (tmp_path / "saving" / "checkpoints").glob("step-*")) == [
        f"step-{step:06d}.ckpt" for step in (3, 6, 9, 12, 15, 18)]


def test_a_run_resumed_from_a_checkpoint_inside_a_window_logs_what_an_uninterrupted_run_logs(
        make_cfg: MakeCfg, tmp_path: Path) -> None:
    runner.fit(make_cfg(*WINDOW, "trainer.ckpt_every_n_steps=3"), run_dir=tmp_path / "straight")
    window = load_checkpoint(tmp_path / "straight", "step-000009.ckpt")["train_window"]
    assert window["steps"] == 4 and window["sums"]["samples"] == 4 * 16 and window["seconds"] > 0
    checkpoint = tmp_path / "straight" / "checkpoints" / "step-000009.ckpt"
    resumed = runner.fit(make_cfg(*WINDOW, f"trainer.ckpt_path={checkpoint}"), run_dir=tmp_path / "resumed")
    straight = logged(tmp_path / "straight")
    assert logged(tmp_path / "resumed") == pytest.approx({step: straight[step] for step in (10, 15, 20)}, rel=1e-6)
    assert resumed["train/loss"] == pytest.approx(final(tmp_path / "straight")["train/loss"], rel=1e-6)


def test_a_run_that_ended_inside_a_window_logs_it_and_a_resume_continues_it(make_cfg: MakeCfg,
                                                                            tmp_path: Path) -> None:
    runner.fit(make_cfg(*WINDOW), run_dir=tmp_path / "straight")
    first = runner.fit(make_cfg(*WINDOW, "trainer.max_steps=12"), run_dir=tmp_path / "first")
    straight = logged(tmp_path / "straight")
    assert list(logged(tmp_path / "first")) == [5, 10, 12]  # the end of the run logs its last steps, 11 and 12
    assert first["train/loss"] == pytest.approx(logged(tmp_path / "first")[12])
    runner.fit(make_cfg(*WINDOW, "trainer.ckpt_path=last"), run_dir=tmp_path / "first")
    assert logged(tmp_path / "first") == pytest.approx({step: straight[step] for step in (15, 20)}, rel=1e-6)
    assert final(tmp_path / "first")["train/loss"] == pytest.approx(final(tmp_path / "straight")["train/loss"],
                                                                    rel=1e-6)


def test_a_run_stopped_by_a_signal_logs_its_last_steps_and_resumes_their_window(make_cfg: MakeCfg,
                                                                                tmp_path: Path) -> None:
    runner.fit(make_cfg(*WINDOW), run_dir=tmp_path / "straight")
    stopped = runner.fit(make_cfg(*WINDOW, f"model._target_={__name__}.SignalAt", "+model.signal_at=7"),
                         run_dir=tmp_path / "stopped")
    assert stopped["step"] == 7 and stopped["stop_signal"] == signal.SIGTERM
    assert list(logged(tmp_path / "stopped")) == [5, 7]
    assert load_checkpoint(tmp_path / "stopped")["train_window"]["steps"] == 2  # steps 6 and 7, still open
    runner.fit(make_cfg(*WINDOW, "trainer.ckpt_path=last"), run_dir=tmp_path / "stopped")
    straight = logged(tmp_path / "straight")
    assert logged(tmp_path / "stopped") == pytest.approx({step: straight[step] for step in (10, 15, 20)}, rel=1e-6)


def test_a_checkpoint_without_a_window_resumes_with_an_empty_one(make_cfg: MakeCfg, tmp_path: Path) -> None:
    losses = step_losses(make_cfg, tmp_path / "each")
    runner.fit(make_cfg(*WINDOW, "trainer.max_steps=12"), run_dir=tmp_path / "first")
    older = load_checkpoint(tmp_path / "first")
    del older["train_window"], older[CHECKSUM_KEY]  # as the runner saved checkpoints before they carried it
    TorchCheckpointIO().save_checkpoint(older, tmp_path / "older.ckpt")
    runner.fit(make_cfg(*WINDOW, f"trainer.ckpt_path={tmp_path / 'older.ckpt'}"), run_dir=tmp_path / "resumed")
    # Step 15 averages steps 13 to 15 alone: what steps 11 and 12 added was not saved.
    assert logged(tmp_path / "resumed") == pytest.approx({15: fmean(losses[s] for s in (13, 14, 15)),
                                                          20: window_means(losses, [20])[20]}, rel=1e-6)


def test_a_checkpoints_seconds_are_not_training_time(make_cfg: MakeCfg, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    slow = 0.5
    save = TorchCheckpointIO.save_checkpoint

    def slow_save(self, checkpoint, path, storage_options=None):
        time.sleep(slow)
        save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", slow_save)
    runner.fit(make_cfg(*WINDOW, "trainer.max_steps=10", "trainer.ckpt_every_n_steps=3",
                        "trainer.limit_val_batches=0"), run_dir=tmp_path)
    # Steps 6-10 hold the saves at 6 and 9 (step-N and last.ckpt each: 2 s of sleep); counted, one sleep alone
    # would hold the window's 80 samples under 160 samples/s.
    assert logged(tmp_path, "throughput/samples_per_s")[10] > 5 * 16 / slow


@pytest.mark.slow
def test_two_processes_carry_their_window_through_a_checkpoint(make_cfg: MakeCfg, tmp_path: Path) -> None:
    # 2 processes x batch 16 over 256 samples: 8 steps an epoch; the checkpoint at step 9 holds steps 6 to 9.
    two = ("strategy=ddp", "trainer.devices=2", "trainer.max_steps=12", "trainer.log_every_n_steps=5",
           "optimizer=sgd")
    runner.fit(make_cfg(*two, "trainer.ckpt_every_n_steps=3"), run_dir=tmp_path / "straight")
    window = load_checkpoint(tmp_path / "straight", "step-000009.ckpt")["train_window"]
    assert window["steps"] == 4 and window["sums"]["samples"] == 4 * 32  # both processes' samples
    checkpoint = tmp_path / "straight" / "checkpoints" / "step-000009.ckpt"
    runner.fit(make_cfg(*two, f"trainer.ckpt_path={checkpoint}"), run_dir=tmp_path / "resumed")
    straight = [(e.step, e.value) for e in read_events(tmp_path / "straight").Scalars("train/loss")]
    resumed = [(e.step, e.value) for e in read_events(tmp_path / "resumed").Scalars("train/loss")]
    assert [step for step, _ in straight] == [5, 10, 12]
    # Rank 0 alone carries the sums in: counted on both, steps 6 to 9 would weigh twice in step 10's mean.
    assert resumed == [(10, pytest.approx(straight[1][1], rel=1e-5)), (12, pytest.approx(straight[2][1], rel=1e-5))]
    assert final(tmp_path / "resumed")["train/loss"] == pytest.approx(final(tmp_path / "straight")["train/loss"],
                                                                      rel=1e-6)


def test_every_param_group_logs_its_lr(make_cfg: MakeCfg, tmp_path: Path) -> None:
    runner.fit(make_cfg("optimizer=sgd", f"optimizer._target_={__name__}.TwoGroupSGD", "optimizer.lr=0.1",
                        "scheduler=linear", "+scheduler.total_steps=20", "trainer.max_steps=4",
                        "trainer.log_every_n_steps=2",
                        f"+logger.recorder._target_={__name__}.Recorder"), run_dir=tmp_path)
    # Linear decay over 20 steps: step k trains at lr x (1 - (k - 1) / 20), and that is the rate logged at step k
    # (as Lightning's LearningRateMonitor logs it), not the next step's.
    assert logged(tmp_path, "lr") == pytest.approx({2: 0.1 * 19 / 20, 4: 0.1 * 17 / 20})
    assert logged(tmp_path, "lr/weights") == pytest.approx({2: 0.1 * 19 / 20, 4: 0.1 * 17 / 20})
    assert logged(tmp_path, "lr/1") == pytest.approx({2: 0.01 * 19 / 20, 4: 0.01 * 17 / 20})
    assert final(tmp_path)["lr/1"] == pytest.approx(0.01 * 17 / 20)
