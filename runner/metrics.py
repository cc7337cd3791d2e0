"""Metrics of the `metrics` config: any object with update(preds, target), compute() and reset().

That is torchmetrics' `Metric` API (torchmetrics metrics reduce their own state over processes when they
compute), and the built-in metrics below, whose state is a tensor of sums reduced through the strategy.
Both are exact with any number of processes, because validation gives each sample to exactly one process.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any, Callable, Literal, Optional

import torch
from torch import nn

from runner.tasks import BatchError

STAGES = ("train", "val")
METHODS = ("update", "compute", "reset")


def is_metric(target: Any) -> bool:
    return all(callable(getattr(target, method, None)) for method in METHODS)


def default_name(target: str) -> str:
    """`torchmetrics.classification.MulticlassF1Score` -> `multiclass_f1_score` (for metrics given as a list)."""
    cls = target.rpartition(".")[2]
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", cls).lower()


class SumMetric(nn.Module):
    """A metric whose state is a tensor of sums over batches and processes; subclasses say what to sum.

    `reduce` sums the state over processes (the runner sets it to the strategy's all-reduce).
    """

    def __init__(self, size: Any) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(size, dtype=torch.float64), persistent=False)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor

    def batch_sums(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def value(self, total: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.total += self.batch_sums(preds, target).to(self.total)

    def compute(self) -> torch.Tensor:
        return self.value(self.reduce(self.total))

    def reset(self) -> None:
        self.total.zero_()


def _labels(preds: torch.Tensor) -> torch.Tensor:
    return preds.argmax(dim=1) if preds.is_floating_point() and preds.dim() > 1 else preds.long()


class Accuracy(SumMetric):
    """The fraction of samples whose target is among the `top_k` highest scores."""

    def __init__(self, top_k: int = 1) -> None:
        super().__init__(2)
        if not (isinstance(top_k, int) and top_k >= 1):
            raise ValueError(f"top_k={top_k} must be a positive integer")
        self.top_k = top_k

    def batch_sums(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.top_k == 1:
            hits = (_labels(preds) == target).sum()
        else:
            hits = (preds.topk(self.top_k, dim=1).indices == target.unsqueeze(1)).any(dim=1).sum()
        return torch.stack([hits.double(), torch.tensor(float(len(target)), device=preds.device)])

    def value(self, total: torch.Tensor) -> torch.Tensor:
        return total[0] / total[1].clamp_min(1)


class MeanSquaredError(SumMetric):
    """The mean over every element of (preds - target)**2."""

    def __init__(self) -> None:
        super().__init__(2)

    def batch_sums(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        error = (preds - target.to(preds.dtype)).double()
        return torch.stack([error.pow(2).sum(), torch.tensor(float(error.numel()), device=preds.device)])

    def value(self, total: torch.Tensor) -> torch.Tensor:
        return total[0] / total[1].clamp_min(1)


class MeanAbsoluteError(MeanSquaredError):
    """The mean over every element of |preds - target|."""

    def batch_sums(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        error = (preds - target.to(preds.dtype)).double()
        return torch.stack([error.abs().sum(), torch.tensor(float(error.numel()), device=preds.device)])


class F1Score(SumMetric):
    """Multiclass F1 from per-class true positive, false positive and false negative counts.

    `average`: macro (the mean of the per-class F1 over the classes that occur in the targets or predictions,
    as torchmetrics' MulticlassF1Score averages), micro (F1 of the pooled counts) or weighted (by support).
    A class id outside 0..num_classes-1, in the targets or the predictions, is an error when computed.
    """

    def __init__(self, num_classes: int, average: Literal["macro", "micro", "weighted"] = "macro") -> None:
        if not (isinstance(num_classes, int) and num_classes >= 2):
            raise ValueError(f"num_classes={num_classes} must be an integer >= 2")
        if average not in ("macro", "micro", "weighted"):
            raise ValueError(f"average={average!r} is not allowed: use macro, micro or weighted")
        super().__init__((4, num_classes))  # true positives, false positives, false negatives; [3, 0]: ids outside
        self.num_classes, self.average = num_classes, average

    def batch_sums(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        predicted, c = _labels(preds), self.num_classes
        inside = (target >= 0) & (target < c) & (predicted >= 0) & (predicted < c)
        predicted, target = predicted[inside], target[inside]
        true_positive = torch.bincount(target[predicted == target], minlength=c)
        predicted_count = torch.bincount(predicted, minlength=c)
        support = torch.bincount(target, minlength=c)
        outside = torch.zeros_like(support)
        outside[0] = (~inside).sum()
        return torch.stack([true_positive, predicted_count - true_positive, support - true_positive, outside])

    def value(self, total: torch.Tensor) -> torch.Tensor:
        tp, fp, fn, outside = total
        if outside[0] > 0:
            raise BatchError(f"F1Score(num_classes={self.num_classes}) was given {int(outside[0])} sample(s) whose "
                             f"target or predicted class is outside 0..{self.num_classes - 1}: set its num_classes "
                             "to the number of classes the model scores")
        if self.average == "micro":
            return 2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum()).clamp_min(1)
        f1 = 2 * tp / (2 * tp + fp + fn).clamp_min(1)
        if self.average == "macro":
            present = (tp + fp + fn) > 0
            return f1[present].sum() / present.sum().clamp_min(1)
        support = tp + fn
        return (f1 * support).sum() / support.sum().clamp_min(1)


class MetricSet:
    """The configured metrics by stage. Every process updates and computes them (a collective); rank 0 logs."""

    def __init__(self, metrics: Mapping[str, tuple[Any, tuple[str, ...]]], strategy: Any) -> None:
        self.by_stage: dict[str, dict[str, Any]] = {stage: {} for stage in STAGES}
        self._tried = False
        for name, (metric, stages) in metrics.items():
            for stage in stages:
                # A metric logged in both stages keeps one state per stage.
                self.by_stage[stage][name] = _placed(metric if stage == stages[0] else copy.deepcopy(metric),
                                                     strategy)

    def wants(self, stage: str) -> Any:
        """Whether `stage`'s steps must give predictions: True, False, or "if given" for training's first step,
        whose predictions, when the task has them, try the validation metrics out."""
        if self.by_stage[stage]:
            return True
        return "if given" if stage == "train" and self._untried else False

    @property
    def _untried(self) -> bool:
        return not self._tried and any(self.by_stage[s] for s in STAGES[1:])

    def update(self, stage: str, out: Mapping[str, Any]) -> None:
        if stage == "train" and self._untried:
            # A metric that cannot take this task's predictions fails at training's first step, not after the
            # training at the first validation: a throwaway copy of each takes that step's outputs.
            # (Not when the step gave none: task=model's model may leave them out when training.)
            self._tried = True
            for other in STAGES[1:] if "preds" in out else ():
                for name, metric in self.by_stage[other].items():
                    trial = _updated(name, copy.deepcopy(metric), out)
                    if isinstance(trial, SumMetric):  # its value on this process alone: no collective
                        _named(name, trial.value, trial.total)
        for name, metric in self.by_stage[stage].items():
            _updated(name, metric, out)

    def compute(self, stage: str, prefix: Optional[str] = None) -> dict[str, float]:
        """`<prefix>/<name>` values (prefix: the stage) over every process, then a fresh state for the next round."""
        values: dict[str, float] = {}
        for name, metric in self.by_stage[stage].items():
            values.update(_scalar_values(f"{prefix or stage}/{name}", _named(name, metric.compute)))
            metric.reset()
        return values


def _named(name: str, call: Callable[..., Any], *args: Any) -> Any:
    """A metric's own refusal (a BatchError) says which metric of the config it is."""
    try:
        return call(*args)
    except BatchError as error:
        raise BatchError(f"metrics.{name}: {error}") from None


def _updated(name: str, metric: Any, out: Mapping[str, Any]) -> Any:
    try:
        metric.update(out["preds"], out["target"])
        return metric
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        preds, target = out["preds"], out["target"]
        shapes = (f"preds {tuple(preds.shape)} {str(preds.dtype).replace('torch.', '')}, target "
                  f"{tuple(target.shape)} {str(target.dtype).replace('torch.', '')}"
                  if isinstance(preds, torch.Tensor) and isinstance(target, torch.Tensor) else "")
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise BatchError(f"metrics.{name} ({type(metric).__name__}) cannot take this task's predictions and "
                         f"targets ({shapes}): {type(error).__name__}: {first}") from None


def _placed(metric: Any, strategy: Any) -> Any:
    """The metric on the strategy's device, a sum metric reducing through the strategy."""
    if isinstance(metric, SumMetric):
        metric.reduce = lambda tensor: strategy.all_reduce(tensor, reduce_op="sum")
    if isinstance(metric, nn.Module):
        metric.to(strategy.root_device)
    return metric


def _scalar_values(key: str, value: Any) -> dict[str, float]:
    if isinstance(value, Mapping):  # e.g. a torchmetrics MetricCollection
        return {k: v for name, item in value.items() for k, v in _scalar_values(f"{key}_{name}", item).items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {key: float(value)}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {key: float(value)}
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise BatchError(f"metrics.{key.partition('/')[2]} computed {shape}, not one number; configure it to give a "
                     "scalar (e.g. average: macro)")
