"""The training loop on a few CPU steps through `runner.fit`: run folder, accumulation, clipping, limits, precisions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from omegaconf import DictConfig

import runner
from conftest import load_checkpoint, read_events, scalar_steps
from runner.build import build_data, build_model
from runner.loop import NonFiniteLossError
from runner.models import MLP

MakeCfg = Callable[..., DictConfig]


def flat_weights(state: dict) -> torch.Tensor:
    return torch.cat([tensor.detach().double().flatten() for tensor in state.values()])


def direct_val_loss(cfg: DictConfig, model_state: dict, samples: int | None = None) -> float:
    """Mean cross-entropy of the saved model over the first `samples` validation samples (all by default)."""
    model = MLP(**{k: v for k, v in cfg.model.items() if k != "_target_"}).double()
    model.load_state_dict(model_state)
    dataset = build_data(cfg).val_dataset
    inputs, targets = dataset.inputs[:samples], dataset.targets[:samples]
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(inputs.double()), targets).item()


def test_three_steps_fill_the_run_folder(cfg: DictConfig, tmp_path: Path) -> None:
    metrics = runner.fit(cfg, run_dir=tmp_path)
    assert metrics["step"] == 3 and metrics["epoch"] == 0 and metrics["stopped_early"] is False
    assert {"train/loss", "val/loss", "val/acc", "lr", "throughput/samples_per_s"} <= metrics.keys()
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["val/loss"] == pytest.approx(metrics["val/loss"]) and saved["step"] == 3
    checkpoint = load_checkpoint(tmp_path)
    assert {"model", "optimizer", "step", "epoch"} <= checkpoint.keys()
    assert checkpoint["step"] == 3 and checkpoint["epoch"] == 0
    events = read_events(tmp_path)
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("val/loss")] == [3]
    assert {"lr", "throughput/samples_per_s", "val/acc"} <= set(events.Tags()["scalars"])
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")


def test_accumulation_matches_the_larger_batch(make_cfg: MakeCfg, tmp_path: Path) -> None:
    common = ("optimizer=sgd", "optimizer.momentum=0.9", "trainer.max_steps=4")
    runner.fit(make_cfg(*common, "data.batch_size=16", "trainer.accumulate_grad_batches=2"), run_dir=tmp_path / "a")
    runner.fit(make_cfg(*common, "data.batch_size=32", "trainer.accumulate_grad_batches=1"), run_dir=tmp_path / "b")
    accumulated, large = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "b")
    assert accumulated["step"] == large["step"] == 4
    assert accumulated["global_batch_size"] == large["global_batch_size"] == 32
    for name, tensor in large["model"].items():
        torch.testing.assert_close(accumulated["model"][name], tensor, rtol=0, atol=1e-5)


def test_gradient_clipping_bounds_each_update(make_cfg: MakeCfg, tmp_path: Path) -> None:
    lr, clip, steps = 0.1, 1e-4, 3
    common = ("optimizer=sgd", f"optimizer.lr={lr}", "optimizer.momentum=0", f"trainer.max_steps={steps}")
    clipped_cfg = make_cfg(*common, f"trainer.gradient_clip_val={clip}")
    runner.fit(clipped_cfg, run_dir=tmp_path / "clipped")
    runner.fit(make_cfg(*common), run_dir=tmp_path / "free")
    torch.manual_seed(clipped_cfg.trainer.seed)  # the worker seeds, then builds the model
    start = flat_weights(build_model(clipped_cfg).state_dict())
    clipped = (flat_weights(load_checkpoint(tmp_path / "clipped")["model"]) - start).norm().item()
    free = (flat_weights(load_checkpoint(tmp_path / "free")["model"]) - start).norm().item()
    # Plain SGD moves by lr x the clipped gradient norm per step, so at most lr x clip per step in total.
    assert 0 < clipped <= steps * lr * clip * (1 + 1e-3)
    assert free > 100 * clipped


@pytest.mark.parametrize("limit", [4, 0.25], ids=["count", "fraction"])
def test_limit_train_batches_shortens_each_epoch(make_cfg: MakeCfg, tmp_path: Path, limit: float) -> None:
    # 256 samples / batch 16 = 16 batches per epoch, limited to 4.
    cfg = make_cfg(f"trainer.limit_train_batches={limit}", "trainer.max_steps=-1", "trainer.max_epochs=2")
    metrics = runner.fit(cfg, run_dir=tmp_path)
    assert (metrics["step"], metrics["epoch"]) == (8, 2)


def test_limit_val_batches_validates_on_that_many_batches(make_cfg: MakeCfg, tmp_path: Path) -> None:
    cfg = make_cfg("trainer.limit_val_batches=2")  # 2 of the 4 validation batches of 16
    metrics = runner.fit(cfg, run_dir=tmp_path)
    expected = direct_val_loss(cfg, load_checkpoint(tmp_path)["model"], samples=32)
    assert metrics["val/loss"] == pytest.approx(expected, abs=1e-5)
    assert metrics["val/loss"] != pytest.approx(direct_val_loss(cfg, load_checkpoint(tmp_path)["model"]), abs=1e-5)


def test_limit_val_batches_zero_skips_validation(make_cfg: MakeCfg, tmp_path: Path) -> None:
    metrics = runner.fit(make_cfg("trainer.limit_val_batches=0"), run_dir=tmp_path)
    assert "val/loss" not in metrics
    assert "val/loss" not in read_events(tmp_path).Tags()["scalars"]


@pytest.mark.parametrize(("overrides", "val_steps"), [
    (("trainer.val_check_interval=2", "trainer.max_steps=6"), [2, 4, 6]),
    (("trainer.val_check_interval=0.5", "trainer.limit_train_batches=4", "trainer.max_steps=-1",
      "trainer.max_epochs=2"), [2, 4, 6, 8]),
    (("trainer.val_check_interval=1.0", "trainer.limit_train_batches=4", "trainer.max_steps=-1",
      "trainer.max_epochs=2"), [4, 8]),
], ids=["every-2-steps", "half-epoch", "epoch"])
def test_val_check_interval(make_cfg: MakeCfg, tmp_path: Path, overrides: tuple, val_steps: list[int]) -> None:
    runner.fit(make_cfg(*overrides), run_dir=tmp_path)
    assert scalar_steps(tmp_path, "val/loss") == val_steps


@pytest.mark.parametrize(("value", "steps"), [("true", 1), ("2", 2)])
def test_fast_dev_run_trains_a_few_batches_and_saves_nothing(make_cfg: MakeCfg, tmp_path: Path, value: str,
                                                             steps: int) -> None:
    metrics = runner.fit(make_cfg(f"trainer.fast_dev_run={value}", "trainer.max_steps=50"), run_dir=tmp_path)
    assert metrics["step"] == steps
    assert "val/loss" in metrics
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(("max_steps", "max_epochs", "step", "epoch"), [
    (5, -1, 5, 0),    # steps first, mid-epoch
    (-1, 1, 16, 1),   # one epoch of 256 / 16 batches
    (100, 1, 16, 1),  # the epoch limit comes first
    (20, 5, 20, 1),   # the step limit comes first, in the second epoch
    (100, None, 100, 6),  # max_epochs left unset: the steps decide, past the 5 epochs it would default to
    (-1, None, 80, 5),    # neither set: 5 epochs
])
def test_max_steps_and_max_epochs_whichever_first(make_cfg: MakeCfg, tmp_path: Path, max_steps: int,
                                                   max_epochs: int, step: int, epoch: int) -> None:
    cfg = make_cfg(f"trainer.max_steps={max_steps}", f"trainer.max_epochs={'null' if max_epochs is None else max_epochs}",
                   "trainer.log_every_n_steps=50")
    metrics = runner.fit(cfg, run_dir=tmp_path)
    assert (metrics["step"], metrics["epoch"]) == (step, epoch)
    assert (load_checkpoint(tmp_path)["step"], load_checkpoint(tmp_path)["epoch"]) == (step, epoch)


@pytest.mark.parametrize(("precision", "dtype"), [
    ("32-true", torch.float32), ("64-true", torch.float64), ("bf16-mixed", torch.float32),
    ("16-true", torch.float16), ("bf16-true", torch.bfloat16),
])
def test_precision_runs_on_cpu_and_saves(make_cfg: MakeCfg, tmp_path: Path, precision: str,
                                         dtype: torch.dtype) -> None:
    # float16 needs an Adam epsilon it can represent (validation says so otherwise).
    eps = ["++optimizer.eps=1e-4"] if precision == "16-true" else []
    metrics = runner.fit(make_cfg(f"precision={precision}", *eps), run_dir=tmp_path)
    assert metrics["step"] == 3
    assert torch.isfinite(torch.tensor([metrics["train/loss"], metrics["val/loss"]])).all()
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint["step"] == 3
    assert {tensor.dtype for tensor in checkpoint["model"].values()} == {dtype}


def test_val_loss_weights_every_sample_equally(make_cfg: MakeCfg, tmp_path: Path) -> None:
    # 50 samples in batches of 16: the last batch holds 2, so a mean of batch means would be off.
    cfg = make_cfg("data.val_samples=50")
    metrics = runner.fit(cfg, run_dir=tmp_path)
    expected = direct_val_loss(cfg, load_checkpoint(tmp_path)["model"])
    assert metrics["val/loss"] == pytest.approx(expected, abs=1e-5)


def test_periodic_checkpoints(make_cfg: MakeCfg, tmp_path: Path) -> None:
    runner.fit(make_cfg("trainer.ckpt_every_n_steps=2", "trainer.max_steps=5"), run_dir=tmp_path)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["last.ckpt", "step-000002.ckpt", "step-000004.ckpt"]
    assert load_checkpoint(tmp_path, "step-000004.ckpt")["step"] == 4
    assert load_checkpoint(tmp_path)["step"] == 5


def test_diverging_loss_stops_with_a_message(make_cfg: MakeCfg, tmp_path: Path) -> None:
    cfg = make_cfg("optimizer=sgd", "optimizer.lr=1e30", "trainer.max_steps=20")
    with pytest.raises(NonFiniteLossError, match="NaN or infinite .* trainer.log_every_n_steps=1"):
        runner.fit(cfg, run_dir=tmp_path)


def test_python_api_compose_and_fit_give_each_call_its_own_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = runner.compose(["trainer.max_steps=2", "data.num_samples=128", "data.val_samples=32"])
    first, second = runner.fit(cfg), runner.fit(cfg)
    assert first["step"] == second["step"] == 2
    folders = sorted(p.parent for p in (tmp_path / "outputs").glob("*/*/metrics.json"))
    assert len(folders) == 2
    assert all((f / ".hydra" / "config.yaml").exists() for f in folders)


def test_final_metrics_are_not_overwritten_when_the_last_step_was_already_logged(make_cfg, tmp_path: Path) -> None:
    # Step 30 is logged because of the checkpoint (every 10), though log_every_n_steps=20.
    metrics = runner.fit(make_cfg("trainer.max_steps=30", "trainer.ckpt_every_n_steps=10",
                                  "trainer.log_every_n_steps=20", "data.num_samples=1024"), run_dir=tmp_path)
    assert metrics["train/loss"] > 0 and metrics["throughput/samples_per_s"] > 0
