"""HuggingFace conventions: unshifted labels under task=language_model, tokens counted under task=model, and
tiny GPT-2 and BERT models built from configs (when transformers is installed), exact per token on 1 and 2 processes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, open_dict

import runner
from conftest import TINY, compose_config, load_checkpoint, read_events
from lm_fixtures import IGNORE, CountingCausalLM, PaddedSequences, TinyCausalLM
from runner.build import build_data, build_model
from runner.checks import validate
from runner.config import ConfigError
from runner.precision import Precision
from runner.tasks import LanguageModelTask, ModelTask, TaskModule

MakeCfg = Callable[..., DictConfig]
TESTS = Path(__file__).resolve().parent
DDP2 = ("strategy=ddp", "trainer.devices=2")
RUN = tuple(o for o in TINY if not o.startswith(("data.", "model.")))


@pytest.fixture
def workers_import_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launched workers import the fixtures (`lm_fixtures.*`) from tests/."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


def lm_cfg(make_cfg: MakeCfg, *overrides: str, batch_size: int, model: str = "lm_fixtures.TinyCausalLM",
           dict_batches: bool = True, report_count: bool = True) -> DictConfig:
    cfg = make_cfg("optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=6", *overrides)
    with open_dict(cfg):
        cfg.model = {"_target_": model, "vocab_size": 16, "dim": 16}
        if not report_count:
            cfg.model.report_count = False
        cfg.data = {"_target_": "lm_fixtures.PaddedSequences", "num_samples": 96, "val_samples": 33,
                    "batch_size": batch_size, "dict_batches": dict_batches}
    return cfg


def saved_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def hand_val_loss(run_dir: Path) -> float:
    """The per-token next-token loss over every validation sequence, one at a time (no padding), from the weights."""
    model = TinyCausalLM(vocab_size=16, dim=16)
    model.load_state_dict(load_checkpoint(run_dir)["model"])
    total = tokens = 0.0
    with torch.no_grad():
        for sequence in PaddedSequences(num_samples=96, val_samples=33).val_dataset.sequences:
            total += F.cross_entropy(model(sequence[None, :-1])[0], sequence[1:], reduction="sum").item()
            tokens += len(sequence) - 1
    return total / tokens


def assert_same_weights(a: Path, b: Path, atol: float = 1e-5) -> None:
    left, right = load_checkpoint(a)["model"], load_checkpoint(b)["model"]
    for name, tensor in left.items():
        torch.testing.assert_close(tensor, right[name], atol=atol, rtol=0, msg=name)


def hf_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    data = PaddedSequences(num_samples=8, val_samples=1, seed=seed, dict_batches=True)
    return data.collate_fn([data.train_dataset[i] for i in range(8)])


class Fixed(torch.nn.Module):
    """Returns the same logits whatever it is given."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.logits


def loss_of(task: Any, batch: Any, logits: torch.Tensor) -> tuple[float, float]:
    """(per-token loss, tokens) the task reports for one batch."""
    out = TaskModule(Fixed(logits), task, Precision())(batch)
    sums = dict(zip(task.stat_names, out["stats"][0].tolist()))
    return task.compute(sums)["loss"], sums["units"]


# -- task.shift_labels under task=language_model ----------------------------------------------------------
def test_language_model_shifts_huggingface_labels_by_default_and_not_pre_shifted_targets() -> None:
    batch = hf_batch()
    ids, labels = batch["input_ids"], batch["labels"]
    logits = torch.randn(*ids.shape, 16)
    shifted_logits, next_tokens = logits[:, :-1].reshape(-1, 16), labels[:, 1:].reshape(-1)
    expected = F.cross_entropy(shifted_logits, next_tokens, ignore_index=IGNORE).item()
    tokens = int((labels[:, 1:] != IGNORE).sum())
    for setting in ("auto", True):
        task = LanguageModelTask(shift_labels=setting)
        assert task.units(batch) == tokens
        assert loss_of(task, batch, logits) == (pytest.approx(expected, rel=1e-5), tokens)
    # Forced off, HuggingFace labels are scored in place: the copy-the-input objective, on every token.
    same_place = F.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1), ignore_index=IGNORE).item()
    assert loss_of(LanguageModelTask(shift_labels=False), batch, logits) == (
        pytest.approx(same_place, rel=1e-5), int((labels != IGNORE).sum()))
    # Targets already shifted (inputs ids[:, :-1], targets labels[:, 1:]) are scored in place under auto.
    pre_shifted = (ids[:, :-1], labels[:, 1:])
    task = LanguageModelTask()
    assert task.units(pre_shifted) == tokens and not task.shift.decided
    assert loss_of(task, pre_shifted, logits[:, :-1]) == (pytest.approx(expected, rel=1e-5), tokens)


def test_auto_decides_once_says_so_in_the_log_and_waits_for_a_batch_with_a_label(
        caplog: pytest.LogCaptureFixture) -> None:
    batch = hf_batch()
    task = LanguageModelTask()
    unscored = {"input_ids": batch["input_ids"], "labels": torch.full_like(batch["labels"], IGNORE)}
    assert task.units(unscored) == 0 and task.shift.decided is None
    with caplog.at_level("INFO", logger="runner"):
        task.units(batch)
        task.units(hf_batch(seed=1))
    said = [r.getMessage() for r in caplog.records if "shift_labels" in r.getMessage()]
    assert said == ["task.shift_labels=auto: the labels equal input_ids (the HuggingFace convention): the logits at "
                    "position t are scored against the label at t + 1 (task.shift_labels=false scores them at t)"]


@pytest.mark.parametrize(("task", "value"), [("language_model", "maybe"), ("language_model", "1"), ("model", "yes")])
def test_a_bad_shift_labels_is_one_line_before_start(task: str, value: str) -> None:
    target = {"language_model": "LanguageModelTask", "model": "ModelTask"}[task]
    with pytest.raises(ConfigError, match=rf"task\.shift_labels={value} must be one of auto or true or false "
                                          rf"\(runner\.tasks\.{target}\)") as error:
        preset = "experiment=hf_style" if task == "model" else "experiment=charlm"
        validate(compose_config([*RUN, preset, f"task={task}", f"++task.shift_labels={value}"]))
    assert len(error.value.problems) == 1 and "\n" not in error.value.problems[0]
    with pytest.raises(ValueError, match=rf"task\.shift_labels='{value}' is not allowed: use auto \(shift when"):
        getattr(runner.tasks, target)(shift_labels=value)  # built from Python, the constructor says the same


@pytest.mark.parametrize("devices", [1, 2], ids=["1-process", "2-processes"])
def test_huggingface_and_pre_shifted_batches_train_the_same_next_token_objective(
        make_cfg: MakeCfg, tmp_path: Path, workers_import_tests: None, devices: int) -> None:
    """Labels = input_ids (HuggingFace) and targets shifted by the data give the same weights, train/loss at every
    step, and a val/loss equal to the per-token loss computed by hand (HuggingFace labels scored in place would
    teach the model to copy its input)."""
    ddp = DDP2 if devices == 2 else ()
    runs = {"hf": lm_cfg(make_cfg, *ddp, "task=language_model", batch_size=16 // devices),
            "pre-shifted": lm_cfg(make_cfg, *ddp, "task=language_model", batch_size=16 // devices,
                                  dict_batches=False)}
    for name, cfg in runs.items():
        runner.fit(cfg, run_dir=tmp_path / name)
    assert_same_weights(tmp_path / "hf", tmp_path / "pre-shifted")
    expected = hand_val_loss(tmp_path / "hf")
    for name in runs:
        metrics = saved_metrics(tmp_path / name)
        assert metrics["val/loss"] == pytest.approx(expected, rel=1e-5), name
        assert metrics["val/perplexity"] == pytest.approx(math.exp(expected), rel=1e-5), name
        assert metrics["throughput/tflops_per_s"] > 0, name  # GPT-2 reads .item(): counted on its first step
    logged = {name: [e.value for e in read_events(tmp_path / name).Scalars("train/loss")] for name in runs}
    assert len(logged["hf"]) == 6 and logged["hf"] == pytest.approx(logged["pre-shifted"], rel=1e-5)
    if devices == 1:
        assert "task.shift_labels=auto: the labels equal input_ids" in (tmp_path / "hf" / "runner.log").read_text()


# -- task=model with task.unit=token: tokens counted from the labels ----------------------------------------
class ConstantLoss(torch.nn.Module):
    """Returns a loss and nothing else, whatever the batch: what the task counts is all there is to see."""

    def forward(self, **batch: Any) -> dict[str, torch.Tensor]:
        return {"loss": torch.tensor(2.0)}


def counted(task: ModelTask, batch: Any) -> tuple[float, float]:
    """(units, loss sum) the task reports for one batch of a model giving no count."""
    samples, units, loss_sum = TaskModule(ConstantLoss(), task, Precision())(batch)["stats"][0].tolist()
    return units, loss_sum


def test_model_task_counts_the_tokens_a_causal_model_scores_when_it_reports_no_count() -> None:
    batch = hf_batch()
    torch.manual_seed(0)
    model, task = CountingCausalLM(report_count=False), ModelTask(unit="token")
    out = TaskModule(model, task, Precision())(batch)
    samples, count, loss_sum, accuracy_sum = out["stats"][0].tolist()
    tokens = int((batch["labels"][:, 1:] != IGNORE).sum())
    assert (samples, count) == (8, tokens) and task.units(batch) == tokens and not task.fixed_units
    # The model's mean over the tokens it scored, weighted by how many: the sum the step back-propagates.
    assert loss_sum == pytest.approx(model(**batch)["loss"].item() * tokens, rel=1e-5)
    assert out["loss"].item() == pytest.approx(loss_sum, rel=1e-6)
    values = task.compute({"samples": samples, "units": count, "loss": loss_sum, "accuracy": accuracy_sum})
    assert values["perplexity"] == pytest.approx(math.exp(loss_sum / count), rel=1e-6)


def test_model_task_counts_masked_labels_unshifted_and_samples_as_before() -> None:
    """Masked-LM labels are not the input ids: every label that is not ignored is a token the model scores."""
    batch = hf_batch()
    masked = batch["labels"].clone()
    masked[:, ::3] = IGNORE
    mlm = {"input_ids": batch["input_ids"].masked_fill(masked != IGNORE, 1), "labels": masked}
    assert counted(ModelTask(unit="token"), mlm) == (int((masked != IGNORE).sum()), 2.0 * int((masked != IGNORE).sum()))
    assert counted(ModelTask(unit="token", shift_labels=True), mlm)[0] == int((masked[:, 1:] != IGNORE).sum())
    assert counted(ModelTask(unit="token", shift_labels=False), batch)[0] == int((batch["labels"] != IGNORE).sum())
    task = ModelTask()
    assert counted(task, batch) == (8, 16.0) and task.fixed_units and "perplexity" not in task.compute(
        {"samples": 8, "units": 8, "loss": 16.0})


@pytest.mark.parametrize(("unit", "why"), [
    ("token", r" and the batch's 'labels' is tensor \(2,\) int64, so its units cannot be counted .*return 'count' "
              r"from the model, or use task\.unit=sample"),
    ("pixel", r", and only samples and tokens are counted without one; return 'count' from the model, or use "
              r"task\.unit=sample or token")])
def test_a_unit_the_batch_cannot_count_is_refused_before_start_not_counted_as_samples(tmp_path: Path, unit: str,
                                                                                       why: str) -> None:
    cfg = compose_config([*RUN, "experiment=hf_style", f"task.unit={unit}"])
    with pytest.raises(ConfigError, match=rf"task\.unit={unit}: the model returned no 'count'{why}"):
        runner.fit(cfg, run_dir=tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_model_task_without_count_is_exact_per_token_on_two_processes_and_micro_batches(
        make_cfg: MakeCfg, tmp_path: Path, workers_import_tests: None) -> None:
    """A model returning only its mean loss (as HuggingFace's do), task.unit=token: the same weights as
    task=language_model, the hand-computed val/loss and its perplexity, and tokens_per_s counting tokens."""
    model = dict(model="lm_fixtures.CountingCausalLM", report_count=False)
    runs = {"two": lm_cfg(make_cfg, *DDP2, "task=model", "task.unit=token", batch_size=8, **model),
            "accumulated": lm_cfg(make_cfg, "task=model", "task.unit=token", "trainer.accumulate_grad_batches=2",
                                  batch_size=8, **model),
            "language_model": lm_cfg(make_cfg, "task=language_model", batch_size=16)}
    for name, cfg in runs.items():
        runner.fit(cfg, run_dir=tmp_path / name)
    expected = hand_val_loss(tmp_path / "language_model")
    for name in runs:
        assert_same_weights(tmp_path / name, tmp_path / "language_model")
        metrics = saved_metrics(tmp_path / name)
        assert metrics["val/loss"] == pytest.approx(expected, rel=1e-5), name
        assert metrics["val/perplexity"] == pytest.approx(math.exp(expected), rel=1e-5), name
        assert metrics["throughput/tflops_per_s"] > 0, name  # GPT-2 reads .item(): counted on its first step
        tokens_per_sample = metrics["throughput/tokens_per_s"] / metrics["throughput/samples_per_s"]
        assert 2 < tokens_per_sample < 11, name  # sequences of 3 to 12 tokens, the first of each not scored
    logged = {name: [e.value for e in read_events(tmp_path / name).Scalars("train/loss")] for name in runs}
    for name in runs:
        assert logged[name] == pytest.approx(logged["language_model"], rel=1e-5), name


# -- HuggingFace's own models, built from configs --------------------------------------------------------
def gpt2_cfg(*overrides: str) -> DictConfig:
    return compose_config([*RUN, "experiment=tiny_gpt2", "trainer.max_steps=5", "data.num_samples=80",
                           "data.val_samples=21", "optimizer=sgd", "optimizer.lr=0.5", *overrides])


def gpt2_hand_val_loss(cfg: DictConfig, run_dir: Path) -> float:
    model = build_model(cfg)
    model.load_state_dict(load_checkpoint(run_dir)["model"])
    data = build_data(cfg)
    total = tokens = 0.0
    with torch.no_grad():
        for sample in data.val_dataset:
            ids = sample["input_ids"]
            logits = model(input_ids=ids[None]).logits[0]
            total += F.cross_entropy(logits[:-1], ids[1:], reduction="sum").item()
            tokens += len(ids) - 1
    return total / tokens


@pytest.mark.slow
def test_tiny_gpt2_under_either_task_gives_the_hand_computed_per_token_loss(tmp_path: Path) -> None:
    """GPT-2's logits scored by the runner (task=language_model, labels shifted as it shifts them) and its own
    loss weighted by the tokens it scores (task=model task.unit=token, GPT-2 returning no count): the same steps
    and the per-token val/loss computed by hand. (Split over processes: the fixtures' tests above.)"""
    pytest.importorskip("transformers")
    runs = {"language_model": gpt2_cfg("data.batch_size=16"),
            "model": gpt2_cfg("task=model", "task.unit=token", "data.batch_size=8",
                              "trainer.accumulate_grad_batches=2")}
    for name, cfg in runs.items():
        runner.fit(cfg, run_dir=tmp_path / name)
    expected = gpt2_hand_val_loss(runs["language_model"], tmp_path / "language_model")
    assert expected < 4.0  # below a uniform guess over 64 tokens (4.16): it learnt
    assert_same_weights(tmp_path / "model", tmp_path / "language_model", atol=1e-5)
    for name in runs:
        metrics = saved_metrics(tmp_path / name)
        assert metrics["val/loss"] == pytest.approx(expected, rel=1e-5), name
        assert metrics["val/perplexity"] == pytest.approx(math.exp(expected), rel=1e-5), name
        assert metrics["throughput/tflops_per_s"] > 0, name  # GPT-2 reads .item(): counted on its first step


@pytest.mark.slow
def test_tiny_bert_counts_its_masked_tokens(tmp_path: Path) -> None:
    """BERT's labels are not its input ids: task=model task.unit=token counts every masked label, unshifted."""
    pytest.importorskip("transformers")
    from runner.examples.hf_lm import IGNORE as HF_IGNORE

    cfg = compose_config([*RUN, "experiment=tiny_bert", "trainer.max_steps=3", "data.num_samples=48",
                          "data.val_samples=21", "data.batch_size=8"])  # validation batches of different sizes
    runner.fit(cfg, run_dir=tmp_path)
    model = build_model(cfg)
    model.load_state_dict(load_checkpoint(tmp_path)["model"])
    data = build_data(cfg)
    total = tokens = 0.0
    with torch.no_grad():
        for sample in data.val_dataset:
            batch = data.collate_fn([sample])  # one at a time: no padding
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[0]
            total += F.cross_entropy(logits, batch["labels"][0], ignore_index=HF_IGNORE, reduction="sum").item()
            tokens += int((batch["labels"] != HF_IGNORE).sum())
    metrics = saved_metrics(tmp_path)
    assert metrics["val/loss"] == pytest.approx(total / tokens, rel=1e-5)
    assert metrics["val/perplexity"] == pytest.approx(math.exp(total / tokens), rel=1e-5)


def test_a_model_that_cannot_read_what_task_model_passes_is_one_line_before_start(tmp_path: Path) -> None:
    """charlm's model takes token ids; task=model hands it the whole batch: refused naming both, not a traceback at
    the first step."""
    cfg = compose_config([*RUN, "experiment=charlm", "task=model", "task.unit=token"])
    with pytest.raises(ConfigError, match=r"model \(runner\.examples\.charlm\.CharTransformer\) cannot be called on "
                                          r"the batches of data \(runner\.examples\.charlm\.StdlibText\) .*task=model "
                                          r"passes to the model whole\): AttributeError"):
        runner.fit(cfg, run_dir=tmp_path)
    assert not (tmp_path / "checkpoints").exists()
