"""Per-step and per-batch callback hooks (what each gets, in which order, at no cost when unused), and
`callbacks=grad_norm` against a hand computation on one process, with accumulation and on two DDP processes."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

import runner
from conftest import load_checkpoint
from hook_fixtures import events
from runner.build import build_data, build_model
from runner.callbacks import Callbacks

MakeCfg = Callable[..., DictConfig]
TESTS = Path(__file__).resolve().parent


def recorder(folder: Path) -> tuple[str, str]:
    return "+callbacks.rec._target_=hook_fixtures.Recorder", f"+callbacks.rec.folder={folder}"


def test_step_and_validation_hooks_come_in_order_with_what_they_document(make_cfg: MakeCfg, tmp_path: Path) -> None:
    cfg = make_cfg(*recorder(tmp_path / "events"), "trainer.accumulate_grad_batches=2", "trainer.max_steps=4",
                   "trainer.val_check_interval=2", "trainer.limit_val_batches=3", "trainer.gradient_clip_val=0.001")
    runner.fit(cfg, run_dir=tmp_path / "run")
    seen = events(tmp_path / "events")
    step_events = []
    for step in range(1, 5):
        step_events += [("on_before_optimizer_step", step), ("on_train_batch_end", step)]
        if step % 2 == 0:
            step_events += [("on_validation_start", step), *[("on_validation_batch_end", i) for i in range(3)],
                            ("on_validation_epoch_end", step), ("on_validation_end", step)]
    assert [(e["hook"], e.get("step", e.get("index"))) for e in seen] == [*step_events, ("on_fit_end", None)]
    for event in seen:
        if event["hook"] == "on_before_optimizer_step":
            # the whole step's gradients, before clipping to 0.001
            assert event["all_grads"] and event["same_optimizer"] and event["norm"] > 0.01
        if event["hook"] == "on_train_batch_end":  # after the step: the gradients are cleared
            assert event["micro_batches"] == 2 and event["samples"] == 32 and event["grads_cleared"]
            assert {"loss", "stats"} <= set(event["keys"])
        if event["hook"] == "on_validation_batch_end":
            assert event["samples"] == 16


class Looked:
    """Counts every attribute look-up on it: how often the hooks are searched for."""

    looked: Counter = Counter()

    def __getattribute__(self, name: str) -> Any:
        Looked.looked[name] += 1
        return object.__getattribute__(self, name)

    def on_fit_start(self, loop: Any) -> None:
        loop.append("started")


def test_hooks_are_looked_up_once_not_per_call() -> None:
    Looked.looked.clear()
    callbacks, calls = Callbacks({"looked": Looked()}), []
    for _ in range(100):
        callbacks.call("on_train_batch_end", calls, [], 1)  # nobody has it: nothing called, nothing looked up again
        callbacks.call("on_fit_start", calls)
    assert calls == ["started"] * 100
    assert Looked.looked["on_train_batch_end"] == 1 and Looked.looked["on_fit_start"] == 1
    assert not callbacks.has("on_train_batch_end") and callbacks.has("on_fit_start")

    class Late:  # added after the first calls, as the heartbeat adds itself
        def on_train_batch_end(self, loop: Any, outputs: list, step: int) -> None:
            loop.append(step)

    callbacks.by_name["late"] = Late()
    callbacks.call("on_train_batch_end", calls, [], 7)
    assert calls[-1] == 7 and callbacks.has("on_train_batch_end")
    del callbacks.by_name["late"]
    assert not callbacks.has("on_train_batch_end")


def csv_column(run_dir: Path, column: str) -> dict[int, float]:
    with open(run_dir / "metrics.csv") as file:
        return {int(row["step"]): float(row[column]) for row in csv.DictReader(file) if row.get(column)}


def hand_grad_norm(cfg: DictConfig, weights: dict) -> float:
    """The 2-norm of the mean cross-entropy's gradient over the whole training set (one global batch)."""
    model = build_model(cfg)
    model.load_state_dict(weights)
    data = build_data(cfg).train_dataset
    loss = F.cross_entropy(model(data.inputs), data.targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))


SPLITS = {"1x64": ("data.batch_size=64",), "1x32-accumulate-2": ("data.batch_size=32", "trainer.accumulate_grad_batches=2"),
          "2x32-ddp": ("data.batch_size=32", "strategy=ddp", "trainer.devices=2"),
          "1x64-clipped": ("data.batch_size=64", "trainer.gradient_clip_val=0.001")}


@pytest.mark.parametrize("split", SPLITS)
def test_grad_norm_is_the_full_steps_norm_before_clipping(make_cfg: MakeCfg, tmp_path: Path, split: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step is the whole 64-sample training set, however split, so step 2's gradient is that of the mean loss
    at step 1's weights; the norm is taken on log steps only, and clipping's own norm is reused."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # workers import the recorder
    taken = []
    norm = torch.nn.utils.get_total_norm
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", lambda *a, **k: taken.append(1) or norm(*a, **k))
    cfg = make_cfg("callbacks=grad_norm", *recorder(tmp_path / "events"), "logger=[tensorboard,csv]", "data.num_samples=64",
                   "trainer.max_steps=4", "trainer.log_every_n_steps=2", "trainer.ckpt_every_n_steps=1",
                   *SPLITS[split])
    runner.fit(cfg, run_dir=tmp_path / "run")
    logged = csv_column(tmp_path / "run", "train/grad_norm")
    assert sorted(logged) == [2, 4]
    for step in (2, 4):
        weights = load_checkpoint(tmp_path / "run", f"step-{step - 1:06d}.ckpt")["model"]
        assert logged[step] == pytest.approx(hand_grad_norm(cfg, weights), rel=1e-5)
    assert logged[2] > 0.01  # the norm before clipping to 0.001 where clipping is on
    if "ddp" not in split:  # in this process: the norm was computed on the 2 log steps only (or reused)
        assert len(taken) == (0 if "clip" in split else 2)
    ends = [events(tmp_path / "events", rank)[-1] for rank in range(2 if "ddp" in split else 1)]
    assert [end["grad_norm"] for end in ends] == [logged[4]] * len(ends)  # every process holds the same value
    if "ddp" in split:  # a launched worker imports the recorder seeded and with the collector paused, then collects
        assert all(not end["collecting_at_import"] and end["collecting"] and end["frozen"] > 0 for end in ends), ends
        assert [end["seed_at_import"] for end in ends] == [cfg.trainer.seed] * 2, ends


def test_grad_norm_in_metrics_json_is_the_last_steps_or_none(make_cfg: MakeCfg, tmp_path: Path) -> None:
    """metrics.json's train/* are the last window's: its grad_norm is the last step's, never an earlier log step's."""
    common = ("callbacks=grad_norm", "logger=[tensorboard,csv]", "data.num_samples=64", "data.batch_size=64",
              "trainer.log_every_n_steps=3", "trainer.ckpt_every_n_steps=1")
    cfg = make_cfg(*common, "trainer.max_steps=7")
    runner.fit(cfg, run_dir=tmp_path / "ends-off-the-grid")
    logged = csv_column(tmp_path / "ends-off-the-grid", "train/grad_norm")
    assert sorted(logged) == [3, 6, 7]
    final = json.loads((tmp_path / "ends-off-the-grid" / "metrics.json").read_text())["train/grad_norm"]
    weights = load_checkpoint(tmp_path / "ends-off-the-grid", "step-000006.ckpt")["model"]
    assert final == logged[7] == pytest.approx(hand_grad_norm(cfg, weights), rel=1e-5)
