"""Several named optimizers, each over a part of the model (`optimizer=parts`, `optimizer.<name>._params_`): every
trainable parameter in exactly one (refused before launch otherwise), each optimizer's state in the checkpoint, an
exact resume, 1 process x 16 equal to 2 x 8 (ddp) and to fsdp's shards; a task with one loss per optimizer
back-propagates each into its part."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import runner
from runner.config import ConfigError

from conftest import TINY, load_checkpoint

TESTS = Path(__file__).resolve().parent
PARTS = ("optimizer=parts", "model.depth=2", "trainer.max_steps=6")
TWO_LOSSES = ("~task", "+task._target_=custom_task_fixtures.TwoLossesTask")
SGD_PARTS = ("optimizer.hidden._target_=torch.optim.SGD", "~optimizer.hidden.weight_decay",
             "~optimizer.hidden._no_decay_", "optimizer.classifier.momentum=0.0")


@pytest.fixture(autouse=True)
def _workers_import_the_fixtures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


def _fit(tmp_path: Path, name: str, *overrides: str) -> dict:
    return runner.fit(runner.compose([*TINY, *PARTS, *overrides]), run_dir=tmp_path / name)


def _same_weights(first: Path, second: Path, atol: float) -> None:
    a, b = load_checkpoint(first)["model"], load_checkpoint(second)["model"]
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, rtol=0, atol=atol, msg=f"model.{name} differs")


def test_each_part_trains_with_its_own_optimizer_and_resumes_exactly(tmp_path: Path) -> None:
    metrics = _fit(tmp_path, "straight")
    assert metrics["lr/hidden"] == 0.003 and metrics["lr/classifier"] == 0.05
    saved = load_checkpoint(tmp_path / "straight")["optimizer"]
    assert saved["names"] == ["hidden", "classifier"] and saved["classes"] == ["AdamW", "SGD"]
    hidden, classifier = saved["optimizers"]
    assert [g["name"] for g in hidden["param_groups"]] == ["hidden", "hidden/no_decay"]
    assert hidden["param_groups"][1]["weight_decay"] == 0.0 and len(hidden["param_groups"][1]["params"]) == 2
    assert {"exp_avg", "exp_avg_sq"} <= set(next(iter(hidden["state"].values())))  # AdamW's moments
    assert set(next(iter(classifier["state"].values()))) == {"momentum_buffer"}  # SGD's, for net.4 only
    assert len(classifier["state"]) == 2
    _fit(tmp_path, "first", "trainer.max_steps=4")
    _fit(tmp_path, "resumed", f"trainer.ckpt_path={tmp_path / 'first' / 'checkpoints' / 'last.ckpt'}")
    _same_weights(tmp_path / "straight", tmp_path / "resumed", atol=0)


@pytest.mark.parametrize(("overrides", "line"), [
    (("optimizer.classifier._params_=[net.2]",),
     r"optimizer: 2 parameter\(s\) are in more than one optimizer's _params_: net.2.weight \(hidden and classifier\)"),
    (("optimizer.hidden._params_=[net.0]",),
     r"optimizer: 2 trainable parameter\(s\) are in no optimizer's _params_: net.2.weight, net.2.bias"),
    (("optimizer.classifier._params_=[head]",),
     r"optimizer.classifier._params_: head matches no trainable parameter of the model"),
    (("+optimizer.classifier.momentun=0.9",), r"optimizer.classifier.momentun is not a setting of optimizer.classifier "
                                              r"\(torch.optim.SGD\) \(did you mean momentum\?\)"),
    (("optimizer.classifier.lr=-1",), r"optimizer.classifier \(torch.optim.SGD\) does not accept its settings"),
    (("strategy=fsdp", *TWO_LOSSES),
     r"task \(custom_task_fixtures.TwoLossesTask\) gives one loss per optimizer, which strategy=fsdp does not run"),
], ids=["twice", "missing", "no-match", "unknown-setting", "bad-lr", "fsdp-losses-per-optimizer"])
def test_parts_are_checked_before_launch(overrides: tuple, line: str) -> None:
    from runner.checks import validate

    with pytest.raises(ConfigError) as refused:
        validate(runner.compose([*TINY, *PARTS, *overrides]))
    assert any(__import__("re").search(line, p) for p in refused.value.problems), refused.value.problems


def test_one_loss_per_optimizer_goes_into_its_part_only(tmp_path: Path) -> None:
    """With plain SGD, `hidden` back-propagating 2 x the loss is `hidden` at twice the rate on the loss itself."""
    _fit(tmp_path, "two_losses", *SGD_PARTS, *TWO_LOSSES, "optimizer.hidden.lr=0.1")
    _fit(tmp_path, "double_rate", *SGD_PARTS, "optimizer.hidden.lr=0.2")
    _same_weights(tmp_path / "two_losses", tmp_path / "double_rate", atol=1e-7)


@pytest.mark.slow
@pytest.mark.xdist_group("optimizer_parts_ddp")
def test_parts_and_losses_per_optimizer_on_one_and_two_processes(tmp_path: Path) -> None:
    """1 process x 16 and 2 x 8: the same weights, with one loss (DDP's hooks) and with one loss per optimizer
    (two backward passes per forward: the gradients are averaged per optimizer after the step's window)."""
    ddp = ("strategy=ddp", "trainer.devices=2", "data.batch_size=8")
    for name, extra in (("one_loss", ()), ("per_optimizer", TWO_LOSSES)):
        _fit(tmp_path, f"{name}1", "data.batch_size=16", *extra)
        _fit(tmp_path, f"{name}2", *ddp, *extra)
        _same_weights(tmp_path / f"{name}1", tmp_path / f"{name}2", atol=2e-6)


@pytest.mark.slow
@pytest.mark.xdist_group("optimizer_parts_ddp")
def test_parts_under_fsdp_resume_on_one_process(tmp_path: Path) -> None:
    """3 steps on 2 FSDP processes x 8 (a sharded folder keying each optimizer's state by parameter name), 3 more on
    1 process x 16 from it: the weights of 6 steps on 1 process."""
    _fit(tmp_path, "straight", "data.batch_size=16")
    _fit(tmp_path, "sharded", "strategy=fsdp", "trainer.devices=2", "data.batch_size=8", "trainer.max_steps=3")
    last = tmp_path / "sharded" / "checkpoints" / "last.ckpt"
    _fit(tmp_path, "resumed", "data.batch_size=16", f"trainer.ckpt_path={last}")
    _same_weights(tmp_path / "straight", tmp_path / "resumed", atol=2e-6)
