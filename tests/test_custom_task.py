"""A training step of one's own: a Task subclass named by `task._target_`, exact on 1 and 2 processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import runner
from conftest import TINY, load_checkpoint, read_events
from custom_task_fixtures import ContrastiveTask, Pairs, contrastive_losses
from runner.build import build_model, build_task
from runner.checks import validate
from runner.config import ConfigError

TESTS = Path(__file__).resolve().parent
# The documented way: drop the task group's option and name the class, with its own settings.
OWN_TASK = ("~task", "+task._target_=custom_task_fixtures.ContrastiveTask", "+task.margin=2.0")
PAIRS = ("~data", "+data._target_=custom_task_fixtures.Pairs", "+data.num_samples=128", "+data.val_samples=37",
         "model.in_features=8", "model.hidden=16", "model.num_classes=4", "optimizer=sgd", "optimizer.lr=0.05",
         "trainer.max_steps=6")
RUN = tuple(o for o in TINY if not o.startswith("data."))


@pytest.fixture
def workers_import_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launched workers import the task and data (`custom_task_fixtures.*`) from tests/."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


def pairs_cfg(*overrides: str):
    """Composed as the command line composes it (runner.compose: with its checks of the overrides and keys)."""
    return runner.compose([*RUN, *PAIRS, *OWN_TASK, *overrides])


def hand_val_loss(cfg, run_dir: Path) -> float:
    """The mean contrastive loss over every validation pair, computed directly with the saved weights."""
    model = build_model(cfg)
    model.load_state_dict(load_checkpoint(run_dir)["model"])
    x1, x2, same = Pairs(num_samples=128, val_samples=37).val_dataset.tensors
    with torch.no_grad():
        return contrastive_losses(model(x1), model(x2), same, margin=2.0).mean().item()


def test_a_task_named_by_its_target_is_built_with_its_settings() -> None:
    cfg = pairs_cfg()
    validate(cfg)
    task = build_task(cfg)
    assert isinstance(task, ContrastiveTask) and task.margin == 2.0


def test_a_bad_setting_of_ones_own_task_is_one_line_before_start() -> None:
    with pytest.raises(ConfigError, match=r"task \(custom_task_fixtures\.ContrastiveTask\) does not accept its "
                                          r"settings: ValueError: task\.margin=-1 must be a positive number") as error:
        validate(pairs_cfg("task.margin=-1"))
    assert len(error.value.problems) == 1 and "\n" not in error.value.problems[0]


def test_ones_own_task_on_two_processes_logs_the_loss_of_one_process_and_of_a_hand_computation(
        tmp_path: Path, workers_import_tests: None) -> None:
    """2 processes x 8 pairs and 1 process x 16: the same weights, train/loss at every step, and a val/loss equal
    to the mean loss over the 37 validation pairs computed directly."""
    runs = {"two": pairs_cfg("strategy=ddp", "trainer.devices=2", "+data.batch_size=8"),
            "one": pairs_cfg("+data.batch_size=16")}
    results = {name: runner.fit(cfg, run_dir=tmp_path / name) for name, cfg in runs.items()}
    left, right = (load_checkpoint(tmp_path / name)["model"] for name in runs)
    for key, tensor in left.items():
        torch.testing.assert_close(tensor, right[key], atol=1e-5, rtol=0, msg=key)
    expected = hand_val_loss(runs["one"], tmp_path / "one")
    for name, metrics in results.items():
        saved = json.loads((tmp_path / name / "metrics.json").read_text())
        assert saved["val/loss"] == pytest.approx(expected, rel=1e-5), name
        assert metrics["val/distance"] > 0 and metrics["throughput/samples_per_s"] > 0, name
    logged = {name: [e.value for e in read_events(tmp_path / name).Scalars("train/loss")] for name in runs}
    assert len(logged["one"]) == 6 and logged["two"] == pytest.approx(logged["one"], rel=1e-5)
