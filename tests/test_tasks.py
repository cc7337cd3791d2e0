"""The step contract: batches of any structure, the four tasks, metrics, and per-unit exactness across processes."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import namedtuple
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, open_dict

import runner
from conftest import TINY, compose_config, load_checkpoint, read_events
from lm_fixtures import IGNORE, CountingCausalLM, NoLoss, PaddedSequences, TinyCausalLM, VectorLoss
from runner.config import ConfigError
from runner.build import build_data, build_model
from runner.checks import validate
from runner.precision import Precision
from runner.strategies.strategy import move_to_device
from runner.tasks import BatchError, ClassificationTask, LanguageModelTask, ModelTask, RegressionTask, TaskModule
from runner.tasks.base import split_batch

MakeCfg = Callable[..., DictConfig]
TESTS = Path(__file__).resolve().parent
DDP2 = ("strategy=ddp", "trainer.devices=2")
TINY_RUN = tuple(o for o in TINY if not o.startswith(("data.", "model.")))  # for presets with their own model and data


@pytest.fixture
def workers_import_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launched workers import the fixtures (`lm_fixtures.*`) from tests/."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


def replace(cfg: DictConfig, **nodes: Any) -> DictConfig:
    with open_dict(cfg):
        for key, value in nodes.items():
            cfg[key] = value
    return cfg


def lm_cfg(make_cfg: MakeCfg, *overrides: str, batch_size: int = 8, model: str = "lm_fixtures.TinyCausalLM",
           dict_batches: bool = False) -> DictConfig:
    cfg = make_cfg("optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=6", *overrides)
    return replace(cfg, model={"_target_": model, "vocab_size": 16, "dim": 16},
                   data={"_target_": "lm_fixtures.PaddedSequences", "num_samples": 96, "val_samples": 33,
                         "batch_size": batch_size, "dict_batches": dict_batches})


def metrics_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def assert_same_weights(a: Path, b: Path, atol: float = 1e-5) -> None:
    left, right = load_checkpoint(a)["model"], load_checkpoint(b)["model"]
    assert left.keys() == right.keys()
    for name, tensor in left.items():
        torch.testing.assert_close(tensor, right[name], atol=atol, rtol=0, msg=name)


# -- batches of any structure --------------------------------------------------------------------------
@dataclasses.dataclass
class Pair:
    features: torch.Tensor
    labels: torch.Tensor
    note: str = "kept"


Named = namedtuple("Named", ["features", "labels"])


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "dataclass", "namedtuple"])
def test_batches_of_any_structure_split_into_inputs_and_targets(kind: str) -> None:
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    batch = {"tuple": (x, y), "list": [x, y], "dict": {"features": x, "labels": y},
             "dataclass": Pair(x, y), "namedtuple": Named(x, y)}[kind]
    moved = move_to_device(batch, torch.device("cpu"))
    assert type(moved) is type(batch)
    inputs, targets = split_batch(moved, "labels", "classification")
    assert torch.equal(targets, y)
    assert torch.equal(inputs["features"] if isinstance(inputs, dict) else inputs, x)


def test_a_batch_of_three_is_refused_naming_the_task_key() -> None:
    with pytest.raises(BatchError, match=r"task\.target_key='labels'.*tuple of 3"):
        split_batch((torch.zeros(2), torch.zeros(2), torch.zeros(2)), "labels", "classification")


def test_dataclass_batches_move_whole_and_keep_other_fields() -> None:
    moved = move_to_device(Pair(torch.ones(2), torch.zeros(2), note="x"), torch.device("cpu"))
    assert isinstance(moved, Pair) and moved.note == "x"


# -- the tasks on one batch ----------------------------------------------------------------------------
def test_classification_top_k_and_soft_targets() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 3.0, 2.0], [1.0, 2.0, 3.0], [3.0, 1.0, 2.0]])
    targets = torch.tensor([1, 1, 0, 2])  # top-1 hits: 1 of 4; top-2 hits: 3 of 4
    task = ClassificationTask(top_k=[1, 2])
    out = task.score(logits, targets)
    sums = dict(zip(task.stat_names, out["stats"][0].tolist()))
    values = task.compute(sums)
    assert values["acc"] == 0.25 and values["acc_top2"] == 0.75
    assert values["loss"] == pytest.approx(F.cross_entropy(logits, targets).item())
    soft = F.one_hot(targets, 3).float()
    assert task.compute(dict(zip(task.stat_names, task.score(logits, soft)["stats"][0].tolist())))["acc"] == 0.25


def test_classification_refuses_language_model_shapes_and_a_large_top_k() -> None:
    with pytest.raises(BatchError, match=r"\(2, 5, 7\).*task=language_model"):
        ClassificationTask().score(torch.randn(2, 5, 7), torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(BatchError, match=r"task\.top_k=\[1, 5\]: 5 is more than the model's 3 classes"):
        ClassificationTask(top_k=[1, 5]).score(torch.randn(4, 3), torch.zeros(4, dtype=torch.long))


def test_classification_takes_float_targets_only_as_probabilities() -> None:
    """Regression targets under task=classification once gave loss 0 and accuracy 1 (one class), or a negative
    cross-entropy: they are refused, pointing to task=regression; mixed labels (rows summing to 1) train."""
    with pytest.raises(BatchError, match=r"1 score per sample .*one class cannot be classified; for real-valued"):
        ClassificationTask().score(torch.randn(4, 1), torch.randn(4, 1))
    with pytest.raises(BatchError, match=r"float targets \(4, 3\) as class probabilities .*task=regression"):
        ClassificationTask().score(torch.randn(4, 3), torch.randn(4, 3))
    mixed = 0.3 * F.one_hot(torch.tensor([0, 1, 2, 0]), 3).float() + 0.7 * F.one_hot(torch.tensor([1, 1, 0, 2]), 3)
    assert torch.isfinite(ClassificationTask().score(torch.randn(4, 3), mixed)["loss"])


def test_regression_refuses_broadcasting_shapes_naming_both() -> None:
    with pytest.raises(BatchError, match=r"output has shape \(8, 1\) but the targets \(8,\)"):
        RegressionTask().score(torch.randn(8, 1), torch.randn(8))


@pytest.mark.parametrize("loss", ["mse", "l1", "huber"])
def test_regression_loss_is_the_mean_over_elements(loss: str) -> None:
    outputs, targets = torch.randn(6, 3), torch.randn(6, 3)
    task = RegressionTask(loss=loss, huber_delta=0.5)
    out = task.score(outputs, targets)
    reference = {"mse": F.mse_loss, "l1": F.l1_loss,
                 "huber": lambda a, b: F.huber_loss(a, b, delta=0.5)}[loss](outputs, targets)
    values = task.compute(dict(zip(task.stat_names, out["stats"][0].tolist())))
    assert values["loss"] == pytest.approx(reference.item(), rel=1e-5)
    assert values["mse"] == pytest.approx(F.mse_loss(outputs, targets).item(), rel=1e-5)
    assert values["mae"] == pytest.approx(F.l1_loss(outputs, targets).item(), rel=1e-5)


def test_language_model_loss_is_per_token_and_ignores_padding() -> None:
    logits, targets = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    targets[0, 3:] = targets[2, 1:] = IGNORE
    task = LanguageModelTask()
    out = task.score(logits, targets)
    sums = dict(zip(task.stat_names, out["stats"][0].tolist()))
    assert sums["units"] == 15 - 2 - 4 == task.units((None, targets))
    expected = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), ignore_index=IGNORE)
    assert task.compute(sums)["loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert task.compute(sums)["perplexity"] == pytest.approx(math.exp(expected.item()), rel=1e-5)
    preds, kept = task.preds(logits, targets)
    assert preds.shape == (9, 11) and kept.shape == (9,) and (kept != IGNORE).all()


@pytest.mark.parametrize(("model", "message"), [
    (NoLoss(), r"task=model: the model returned \{'logits': tensor \(4, 2\) float32\} without a 'loss'"),
    (VectorLoss(), r"task=model: the model's loss has shape \(4,\); it must be a scalar"),
])
def test_model_task_refuses_outputs_without_a_scalar_loss(model: torch.nn.Module, message: str) -> None:
    with pytest.raises(BatchError, match=message):
        TaskModule(model, ModelTask(), Precision())((torch.randn(4, 3), torch.zeros(4)))


def test_model_task_weights_its_scalars_by_count() -> None:
    data = PaddedSequences(num_samples=8, val_samples=1, dict_batches=True)
    batch = data.collate_fn([data.train_dataset[i] for i in range(8)])
    task = ModelTask(unit="token")
    out = TaskModule(CountingCausalLM(), task, Precision())(batch)
    assert task.stat_names == ("samples", "units", "loss", "accuracy")
    samples, count, loss_sum, accuracy_sum = out["stats"][0].tolist()
    tokens = int((batch["labels"][:, 1:] != IGNORE).sum())
    assert (samples, count) == (8, tokens)
    assert loss_sum / count == pytest.approx(out["loss"].item() / tokens, rel=1e-5)
    assert 0 <= accuracy_sum / count <= 1


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor
    margin: float


class ObjectOutput(torch.nn.Module):
    """Takes a dataclass batch whole and returns an object with attributes, not a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, batch: Pair) -> Output:
        logits = self.linear(batch.features)
        return Output(F.cross_entropy(logits, batch.labels), logits, margin=2.0)


def test_model_task_takes_dataclass_batches_whole_and_object_outputs() -> None:
    task = ModelTask()
    batch = Pair(torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1]))
    out = TaskModule(ObjectOutput(), task, Precision())(batch, with_preds=True)
    assert task.stat_names == ("samples", "units", "loss", "margin")
    values = task.compute(dict(zip(task.stat_names, out["stats"][0].tolist())))
    assert values["margin"] == pytest.approx(2.0) and out["preds"].shape == (5, 2)
    assert torch.equal(out["target"], batch.labels)


# -- each task through runner.fit, on 1 process and on 2 gloo processes ---------------------------------
def test_default_classification_logs_what_it_logged_before(cfg: DictConfig, tmp_path: Path) -> None:
    metrics = runner.fit(cfg, run_dir=tmp_path)
    assert {"train/loss", "train/acc", "val/loss", "val/acc", "throughput/samples_per_s"} <= metrics.keys()
    assert not any(key.startswith("throughput/tokens") for key in metrics)


@pytest.mark.parametrize("devices", [1, 2], ids=["1-process", "2-processes"])
def test_regression_reports_exact_mse_and_mae(make_cfg: MakeCfg, tmp_path: Path, devices: int) -> None:
    cfg = make_cfg("experiment=regression", "data.num_features=8", "data.val_samples=33",
                   *(DDP2 if devices == 2 else ()), f"data.batch_size={16 // devices}")
    metrics = runner.fit(cfg, run_dir=tmp_path)
    model = build_model(cfg)
    model.load_state_dict(load_checkpoint(tmp_path)["model"])
    data = build_data(cfg).val_dataset
    with torch.no_grad():
        predictions = model(data.inputs)
    assert predictions.shape == data.targets.shape == (33, 1)
    assert metrics["val/mse"] == pytest.approx(F.mse_loss(predictions, data.targets).item(), rel=1e-5)
    assert metrics["val/mae"] == pytest.approx(F.l1_loss(predictions, data.targets).item(), rel=1e-5)
    assert metrics["val/loss"] == pytest.approx(metrics["val/mse"])


def test_regression_shape_mismatch_stops_the_run_with_one_message(make_cfg: MakeCfg, tmp_path: Path) -> None:
    cfg = make_cfg("task=regression", "data=synthetic_regression", "model.num_classes=1", "data.num_features=8")
    with open_dict(cfg):
        cfg.data.num_outputs = 2  # (B, 1) predictions against (B, 2) targets
    # Found before any worker starts: the parent runs a couple of samples through the model and the task.
    with pytest.raises(ConfigError, match=r"output has shape \(2, 1\) but the targets \(2, 2\)"):
        runner.fit(cfg, run_dir=tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def direct_lm_val_loss(cfg: DictConfig, run_dir: Path) -> float:
    model = TinyCausalLM(vocab_size=16, dim=16)
    model.load_state_dict(load_checkpoint(run_dir)["model"])
    data = PaddedSequences(num_samples=96, val_samples=33)
    total = tokens = 0.0
    with torch.no_grad():
        for sequence in data.val_dataset.sequences:  # one at a time: no padding at all
            logits = model(sequence[None, :-1])
            total += F.cross_entropy(logits[0], sequence[1:], reduction="sum").item()
            tokens += len(sequence) - 1
    return total / tokens


def test_language_model_split_over_processes_and_micro_batches_gives_the_same_step(
        make_cfg: MakeCfg, tmp_path: Path, workers_import_tests: None) -> None:
    """2 processes x B, 1 x 2B and 1 x B x accumulate 2 on variable-length sequences: the same weights and val/loss."""
    runs = {"two": lm_cfg(make_cfg, *DDP2, "task=language_model", batch_size=8),
            "one": lm_cfg(make_cfg, "task=language_model", batch_size=16),
            "accumulated": lm_cfg(make_cfg, "task=language_model", "trainer.accumulate_grad_batches=2", batch_size=8)}
    results = {name: runner.fit(cfg, run_dir=tmp_path / name) for name, cfg in runs.items()}
    assert_same_weights(tmp_path / "two", tmp_path / "one")
    assert_same_weights(tmp_path / "accumulated", tmp_path / "one")
    expected = direct_lm_val_loss(runs["one"], tmp_path / "one")
    for name, metrics in results.items():
        assert metrics["step"] == 6, name
        assert metrics["val/loss"] == pytest.approx(expected, rel=1e-5), name
        assert metrics["val/perplexity"] == pytest.approx(math.exp(expected), rel=1e-5), name
        assert metrics["throughput/tokens_per_s"] > 0
    # Logged per token too: the train loss of a step is the same whatever the split.
    logged = {name: read_events(tmp_path / name).Scalars("train/loss") for name in runs}
    for name, events in logged.items():
        assert [e.step for e in events] == list(range(1, 7)), name
        assert [e.value for e in events] == pytest.approx([e.value for e in logged["one"]], rel=1e-5), name


def test_a_model_reporting_count_trains_as_the_language_model_task_and_without_count_it_would_not(
        make_cfg: MakeCfg, tmp_path: Path) -> None:
    """The per-token equivalences are not vacuous: weighting each micro-batch's mean equally moves the weights."""
    runner.fit(lm_cfg(make_cfg, "task=language_model", batch_size=16), run_dir=tmp_path / "tokens")
    model = "lm_fixtures.CountingCausalLM"
    runner.fit(lm_cfg(make_cfg, "task=model", model=model, batch_size=16, dict_batches=True), run_dir=tmp_path / "count")
    assert_same_weights(tmp_path / "count", tmp_path / "tokens")
    cfg = lm_cfg(make_cfg, "task=model", "trainer.accumulate_grad_batches=2", model=model, batch_size=8,
                 dict_batches=True)
    with open_dict(cfg):
        cfg.model.report_count = False
    runner.fit(cfg, run_dir=tmp_path / "batch-means")
    with pytest.raises(AssertionError):
        assert_same_weights(tmp_path / "batch-means", tmp_path / "tokens", atol=1e-4)


def test_model_task_with_count_split_over_processes_and_micro_batches(
        make_cfg: MakeCfg, tmp_path: Path, workers_import_tests: None) -> None:
    """A HuggingFace-style model with dict batches and its own loss, returning `count`: exact per token on DDP."""
    common = ("task=model", "task.unit=token")
    runs = {"two": lm_cfg(make_cfg, *DDP2, *common, batch_size=8, model="lm_fixtures.CountingCausalLM",
                          dict_batches=True),
            "one": lm_cfg(make_cfg, *common, batch_size=16, model="lm_fixtures.CountingCausalLM", dict_batches=True),
            "accumulated": lm_cfg(make_cfg, *common, "trainer.accumulate_grad_batches=2", batch_size=8,
                                  model="lm_fixtures.CountingCausalLM", dict_batches=True)}
    results = {name: runner.fit(cfg, run_dir=tmp_path / name) for name, cfg in runs.items()}
    assert_same_weights(tmp_path / "two", tmp_path / "one")
    assert_same_weights(tmp_path / "accumulated", tmp_path / "one")
    for name, metrics in results.items():
        assert metrics["val/loss"] == pytest.approx(results["one"]["val/loss"], rel=1e-5), name
        assert metrics["val/accuracy"] == pytest.approx(results["one"]["val/accuracy"], rel=1e-5), name
        assert "train/accuracy" in metrics and metrics["throughput/tokens_per_s"] > 0


def test_model_task_without_count_trains_a_dict_batch_model_on_ddp(tmp_path: Path) -> None:
    """experiment=hf_style: {"input_ids", "attention_mask", "labels"} batches, a model returning {"loss", "logits"}."""
    overrides = (*TINY_RUN, "experiment=hf_style", "data.num_samples=256", "data.val_samples=33",
                 "trainer.max_steps=8", "optimizer=sgd", "optimizer.lr=0.5")
    two = runner.fit(compose_config([*overrides, *DDP2, "data.batch_size=8"]), run_dir=tmp_path / "two")
    one = runner.fit(compose_config([*overrides, "data.batch_size=16"]), run_dir=tmp_path / "one")
    assert_same_weights(tmp_path / "two", tmp_path / "one")
    assert two["val/loss"] == pytest.approx(one["val/loss"], rel=1e-5)
    assert two["val/f1"] == pytest.approx(one["val/f1"], abs=1e-9)


# -- metrics ------------------------------------------------------------------------------------------
F1 = ("+metrics.f1._target_=torchmetrics.classification.MulticlassF1Score", "+metrics.f1.num_classes=4",
      "+metrics.f1.average=macro", "+metrics.own_f1._target_=runner.metrics.F1Score", "+metrics.own_f1.num_classes=4",
      "+metrics.top2._target_=runner.metrics.Accuracy", "+metrics.top2.top_k=2", "+metrics.top2._stages_=[train,val]",
      "task.top_k=[1,2]")


def test_metrics_count_every_validation_sample_once_on_two_processes(make_cfg: MakeCfg, tmp_path: Path) -> None:
    pytest.importorskip("torchmetrics")
    common = (*F1, "data.val_samples=333", "trainer.max_steps=4")
    two = runner.fit(make_cfg(*common, *DDP2, "data.batch_size=8"), run_dir=tmp_path / "two")
    one = runner.fit(make_cfg(*common, "data.batch_size=16"), run_dir=tmp_path / "one")
    assert_same_weights(tmp_path / "two", tmp_path / "one")
    # The reference: the saved model over all 333 samples, computed directly.
    cfg = make_cfg(*common)
    model = build_model(cfg)
    model.load_state_dict(load_checkpoint(tmp_path / "one")["model"])
    data = build_data(cfg).val_dataset
    with torch.no_grad():
        predicted = model(data.inputs).argmax(dim=1)
    from torchmetrics.functional.classification import multiclass_f1_score

    expected = multiclass_f1_score(predicted, data.targets, num_classes=4, average="macro").item()
    for metrics in (one, two):
        assert metrics["val/f1"] == pytest.approx(expected, abs=1e-6)
        assert metrics["val/own_f1"] == pytest.approx(expected, abs=1e-6)
        assert metrics["val/top2"] == pytest.approx(metrics["val/acc_top2"], abs=1e-9)
        assert "train/top2" in metrics and "train/f1" not in metrics
    assert two["val/acc"] == pytest.approx(one["val/acc"], abs=1e-9)
    assert two["train/top2"] == pytest.approx(one["train/top2"], abs=1e-9)
    events = read_events(tmp_path / "two").Tags()["scalars"]
    assert {"val/f1", "val/own_f1", "val/top2", "train/top2", "val/acc_top2"} <= set(events)


def test_a_metric_can_be_the_objective_of_a_sweep_job(make_cfg: MakeCfg, tmp_path: Path) -> None:
    cfg = make_cfg("+metrics.f1._target_=runner.metrics.F1Score", "+metrics.f1.num_classes=4", "objective=val/f1")
    assert cfg.objective in runner.fit(cfg, run_dir=tmp_path)


@pytest.mark.parametrize(("overrides", "message"), [
    (("+metrics.bad._target_=torch.nn.Linear", "+metrics.bad.in_features=2", "+metrics.bad.out_features=2"),
     r"metrics\.bad\._target_=torch\.nn\.Linear is not a metric: a metric has update\(preds, target\)"),
    (("+metrics.f1._target_=runner.metrics.F1Score",), r"metrics\.f1 \(runner\.metrics\.F1Score\) does not accept"),
    (("+metrics.f1._target_=torchmetrics.classification.MulticlassF1Score", "+metrics.f1.num_class=4"),
     r"missing 1 required positional argument: 'num_classes'; metrics\.f1\.num_class is not one of its parameters "
     r"\(did you mean num_classes\?\)"),
    (("+metrics.f1._target_=runner.metrics.F1Score", "+metrics.f1.num_classes=4", "+metrics.f1._stages_=[test]"),
     r"metrics\.f1\._stages_=\['test'\] is not allowed"),
    (("task.top_k=[1,5]",), r"task\.top_k=\[1, 5\] asks for more than data\.num_classes=4"),
    (("task.top_k=[0]",), r"task\.top_k=\[0\] must be a list of positive integers"),
    (("task=regression", "task.loss=mae"), r"task\.loss=mae must be one of mse, l1, huber"),
])
def test_bad_task_and_metric_settings_are_refused_before_start(make_cfg: MakeCfg, overrides: tuple,
                                                               message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(*overrides))


def test_a_mistyped_task_value_fails_at_composition_naming_the_key(make_cfg: MakeCfg) -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=r"task\.ignore_index=pad"):
        make_cfg("task=language_model", "task.ignore_index=pad")


def test_a_non_scalar_metric_names_its_key(make_cfg: MakeCfg, tmp_path: Path) -> None:
    pytest.importorskip("torchmetrics")
    cfg = make_cfg("+metrics.per_class._target_=torchmetrics.classification.MulticlassF1Score",
                   "+metrics.per_class.num_classes=4", "+metrics.per_class.average=none")
    with pytest.raises(BatchError, match=r"metrics\.per_class computed \(4,\), not one number"):
        runner.fit(cfg, run_dir=tmp_path)


@pytest.mark.parametrize(("target", "message"), [
    ("lm_fixtures.NoLoss", r"without a 'loss'"), ("lm_fixtures.VectorLoss", r"must be a scalar")])
def test_model_task_errors_reach_the_command_line_as_one_line(tmp_path: Path, target: str, message: str) -> None:
    from _dist import clean_environ, run_cli

    result = run_cli(["task=model", f"model._target_={target}", "~model.in_features", "~model.hidden",
                      "~model.depth", "~model.num_classes", "trainer.max_steps=2", f"hydra.run.dir={tmp_path}"],
                     env=clean_environ(PYTHONPATH=str(TESTS)), cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1
    assert re.search(message, result.stderr), result.stderr


def test_a_metric_that_cannot_take_the_tasks_outputs_fails_at_the_first_step(make_cfg: MakeCfg,
                                                                             tmp_path: Path) -> None:
    """Not after the training, at the first validation: a copy of each validation metric tries step 1's outputs."""
    for overrides, message in (
            (("+metrics.mse._target_=runner.metrics.MeanSquaredError",),
             r"metrics\.mse \(MeanSquaredError\) cannot take this task's predictions and targets \(preds \(16, 4\) "
             r"float32, target \(16,\) int64\): RuntimeError"),
            (("+metrics.f1._target_=runner.metrics.F1Score", "+metrics.f1.num_classes=2"),
             r"metrics\.f1: F1Score\(num_classes=2\) was given \d+ sample\(s\) whose target or predicted class is "
             r"outside 0\.\.1")):
        run_dir = tmp_path / overrides[-1].replace("/", "_")
        with pytest.raises(BatchError, match=message):
            runner.fit(make_cfg(*overrides, "trainer.max_steps=50", "trainer.val_check_interval=50"), run_dir=run_dir)
        assert "step 2/" not in (run_dir / "runner.log").read_text()


def test_builtin_f1_averages_over_the_classes_present_and_refuses_ids_outside_its_classes() -> None:
    from torchmetrics.classification import MulticlassF1Score

    from runner.metrics import F1Score

    generator = torch.Generator().manual_seed(0)
    target = torch.randint(0, 3, (50,), generator=generator)  # class 3 is never a target...
    preds = torch.randn(50, 4, generator=generator)
    preds[:, 3] = -10  # ...nor predicted
    for average in ("macro", "micro", "weighted"):
        ours, theirs = F1Score(4, average), MulticlassF1Score(4, average=average)
        ours.update(preds, target)
        theirs.update(preds, target)
        assert float(ours.compute()) == pytest.approx(float(theirs.compute()), abs=1e-6)
    narrow = F1Score(2)
    narrow.update(preds, target)
    with pytest.raises(BatchError, match=r"F1Score\(num_classes=2\) was given \d+ sample\(s\)"):
        narrow.compute()


def test_a_class_id_the_model_has_no_score_for_names_the_setting(make_cfg: MakeCfg, tmp_path: Path) -> None:
    """Found by the data's trial batch through the model (on the CPU for a small model on a CPU run), before the
    first step; a large model's first step says the same."""
    with pytest.raises(ConfigError, match=r"task=classification: Target \d is out of bounds for a model giving 2 "
                                          r"scores per sample: the model's number of classes \(e\.g\. "
                                          r"model\.num_classes\)"):
        runner.fit(make_cfg("model.num_classes=2"), run_dir=tmp_path)


def test_a_model_that_does_not_take_the_batch_keys_is_refused_before_the_first_step(make_cfg: MakeCfg,
                                                                                    tmp_path: Path) -> None:
    cfg = lm_cfg(make_cfg, "task=model", dict_batches=True)  # TinyCausalLM.forward(input_ids): no labels
    with pytest.raises(ConfigError, match=r"model \(lm_fixtures\.TinyCausalLM\) cannot be called on the batches of "
                                          r"data \(lm_fixtures\.PaddedSequences\) with the keys input_ids, labels: "
                                          r"TypeError: .*forward\(\) got an unexpected keyword argument 'labels'"):
        runner.fit(cfg, run_dir=tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_a_model_without_logits_in_training_still_trains_and_validates_its_metrics(tmp_path: Path) -> None:
    """The first step's trial of the validation metrics needs predictions; a model that gives none is let be."""
    cfg = compose_config([*TINY_RUN, "experiment=hf_style", "model._target_=lm_fixtures.LossOnlyWhenTraining",
                          "data.num_samples=64", "data.val_samples=33", "trainer.max_steps=3"])
    metrics = runner.fit(cfg, run_dir=tmp_path)
    assert metrics["step"] == 3 and 0.0 <= metrics["val/f1"] <= 1.0


def test_predict_gives_the_model_the_inputs_of_one_tensor_and_pair_samples() -> None:
    """A TensorDataset(x) yields one-tensor samples, batched as [x]: the model gets x, not the list; a supervised
    task's (inputs, targets) pair gives it the inputs, as in training. task=model gets the batch as it trains."""
    torch.manual_seed(0)
    model, x = torch.nn.Linear(4, 3), torch.randn(5, 4)
    expected = model(x).detach()
    for task in (ClassificationTask(), RegressionTask()):
        module = TaskModule(model, task, Precision())
        for batch in ([x], (x,), [x, torch.zeros(5, dtype=torch.long)]):
            torch.testing.assert_close(module.predict(batch), expected)
    seen = []
    TaskModule(lambda batch: seen.append(batch) or {"logits": x}, ModelTask(), Precision()).predict((x, x))
    assert isinstance(seen[0], tuple) and len(seen[0]) == 2


def test_task_model_on_tuple_batches_is_refused_before_start_saying_the_model_gets_the_batch_whole() -> None:
    cfg = compose_config([*TINY, "task=model"])  # the default MLP on (inputs, targets) pairs
    with pytest.raises(ConfigError, match=r"cannot be called on the batches of data .*\(each a \w+, which task=model "
                                          r"passes to the model whole\): TypeError: .*must be Tensor, not"):
        build_data(cfg)  # each process checks the batches where it builds its data


def test_a_unit_given_as_a_plural_is_not_doubled() -> None:
    from runner.tasks.base import plural

    assert plural("token") == plural("tokens") == "tokens" and plural("sample") == "samples"


@pytest.mark.parametrize(("target", "message"), [
    ("lm_fixtures.NoBatchSize", r"data \(lm_fixtures\.NoBatchSize\) has batch_size=None: a data object needs a "
                                r"positive integer batch_size"),
    ("lm_fixtures.UnreadableTrain", r"data \(lm_fixtures\.UnreadableTrain\)\.train_dataset is _Counter: neither "
                                    r"a map-style dataset \(len\(\) and indexing\) nor a stream"),
])
def test_a_data_object_missing_what_the_loop_reads_is_one_line(target: str, message: str) -> None:
    """Once an AttributeError or `object of type ... has no len()` traceback from inside the loader."""
    cfg = compose_config([*(o for o in TINY if not o.startswith("data.")), "~data", f"+data._target_={target}",
                          "model.in_features=32", "model.num_classes=4"])
    with pytest.raises(ConfigError, match=message):
        build_data(cfg)
