"""Tasks whose loss the runner computes from the model's output and the batch's targets."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from runner.tasks.base import BatchError, Task, call_model, logits_of, split_batch, stats_row
from runner.tasks.shift import LabelShift, ShiftSetting


def _check_target_key(task: str, target_key: Any) -> str:
    if not (isinstance(target_key, str) and target_key):
        raise ValueError(f"task.target_key={target_key!r} must be the name of the targets in dict batches")
    return target_key


class _Supervised(Task):
    """Calls the model on the batch's inputs; subclasses score its predictions against the targets."""

    takes_pairs = True

    def __init__(self, target_key: str) -> None:
        self.target_key = _check_target_key(self.name, target_key)

    def forward(self, model: nn.Module, batch: Any, precision: Any, with_preds: bool) -> dict[str, Any]:
        inputs, targets = split_batch(batch, self.target_key, self.name)
        inputs = precision.convert_input(inputs)
        with precision.forward_context():
            outputs = precision.convert_output(logits_of(call_model(model, inputs), self.name))
            out = self.score(outputs, targets)
        if with_preds:
            out["preds"], out["target"] = self.preds(outputs, targets)
        return out

    def score(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        raise NotImplementedError

    def preds(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a metric's `update(preds, target)` gets."""
        return outputs.detach().float(), targets

    def units(self, batch: Any) -> Optional[int]:
        return len(split_batch(batch, self.target_key, self.name)[1])


class ClassificationTask(_Supervised):
    """Cross-entropy on logits (N, C) against class indices (N,) or class probabilities (N, C).

    Logs `loss` and `acc` (top-1), and `acc_top<k>` for every other k in `top_k`, all per sample.
    """

    name = "classification"

    def __init__(self, top_k: Sequence[int] = (1,), label_smoothing: float = 0.0, target_key: str = "labels") -> None:
        super().__init__(target_key)
        top_k = list(top_k) if isinstance(top_k, Sequence) and not isinstance(top_k, str) else [top_k]
        if not top_k or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in top_k):
            raise ValueError(f"task.top_k={top_k} must be a list of positive integers, e.g. [1,5]")
        if not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing < 1.0):
            raise ValueError(f"task.label_smoothing={label_smoothing} must be in [0, 1)")
        self.top_k = sorted(set(top_k) | {1})
        self.label_smoothing = float(label_smoothing)
        self._probabilities_seen = False  # float targets checked to be probabilities (on the first such batch)
        self.extra_stats = tuple(f"correct_top{k}" for k in self.top_k)

    def score(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        self._check(logits, targets)
        loss = _cross_entropy(self.name, logits, targets, reduction="sum", label_smoothing=self.label_smoothing)
        labels = targets if targets.dim() == 1 else targets.argmax(dim=1)
        detached = logits.detach()
        if len(self.top_k) == 1:
            correct = [(detached.argmax(dim=1) == labels).sum()]
        else:
            hits = detached.topk(self.top_k[-1], dim=1).indices == labels.unsqueeze(1)
            correct = [hits[:, :k].sum() for k in self.top_k]
        n = len(targets)
        return {"loss": loss, "stats": stats_row(n, n, loss, *correct)}

    def _check(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        classes = logits.shape[-1]
        pair = logits.dim() == 2 and (
            (targets.dim() == 1 and not targets.is_floating_point() and len(targets) == len(logits))
            or (targets.shape == logits.shape and targets.is_floating_point()))
        if not pair:
            hint = " (for (B, T, V) logits use task=language_model)" if logits.dim() == 3 else ""
            raise BatchError(f"task=classification needs logits (N, C) and class indices (N,) or probabilities "
                             f"(N, C); the model returned {tuple(logits.shape)} for targets {tuple(targets.shape)} "
                             f"{str(targets.dtype).replace('torch.', '')}{hint}")
        if self.top_k[-1] > classes:
            raise BatchError(f"task.top_k={self.top_k}: {self.top_k[-1]} is more than the model's {classes} classes")
        if targets.is_floating_point() and not self._probabilities_seen:
            _check_probabilities(logits, targets)  # once: its .item() would wait for the device at every step
            self._probabilities_seen = True

    def compute(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["samples"], 1.0)
        values = {"loss": sums["loss"] / max(sums["units"], 1.0)}
        for k in self.top_k:
            values["acc" if k == 1 else f"acc_top{k}"] = sums[f"correct_top{k}"] / n
        return values


_REGRESSION_LOSSES = ("mse", "l1", "huber")


def _check_probabilities(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Float targets (N, C) are class probabilities: refuse others (regression values, scores) by name."""
    advice = "for real-valued targets use task=regression"
    if logits.shape[-1] < 2:
        raise BatchError(f"task=classification: the model gives 1 score per sample and the targets are "
                         f"{str(targets.dtype).replace('torch.', '')}: one class cannot be classified; {advice}")
    detached = targets.detach()
    off = torch.stack([(-detached).max(), detached.max() - 1, (detached.sum(dim=1) - 1).abs().max()]).max()
    if off.item() > 1e-3:  # a single check of the batch: below 0, above 1, or rows not summing to 1
        raise BatchError(f"task=classification takes float targets {tuple(targets.shape)} as class probabilities "
                         f"(each in [0, 1], each row summing to 1), but these are not (values from "
                         f"{detached.min().item():.4g} to {detached.max().item():.4g}); {advice}, or give class ids")


class RegressionTask(_Supervised):
    """Predictions against float targets of exactly the same shape (no broadcasting): `mse`, `l1` or `huber` loss.

    Each sample's loss and errors are its mean over output elements; logs `loss`, `mse` and `mae` per sample.
    """

    name = "regression"
    extra_stats = ("squared_error", "absolute_error")

    def __init__(self, loss: Literal["mse", "l1", "huber"] = "mse", huber_delta: float = 1.0,
                 target_key: str = "labels") -> None:
        super().__init__(target_key)
        if loss not in _REGRESSION_LOSSES:
            raise ValueError(f"task.loss={loss!r} is not allowed: use {', '.join(_REGRESSION_LOSSES)}")
        if not (isinstance(huber_delta, (int, float)) and huber_delta > 0):
            raise ValueError(f"task.huber_delta={huber_delta} must be a positive number")
        self.loss, self.huber_delta = loss, float(huber_delta)

    def score(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        if outputs.shape != targets.shape:
            raise BatchError(f"task=regression: the model's output has shape {tuple(outputs.shape)} but the targets "
                             f"{tuple(targets.shape)}; they must match exactly (no broadcasting), e.g. reshape the "
                             "targets in the data set or squeeze the model's output")
        targets = targets.to(outputs.dtype)
        n = len(targets)
        per_sample = max(outputs[0].numel(), 1) if n else 1  # elements per sample: each sample's mean
        error = outputs - targets
        if self.loss == "mse":
            loss = error.pow(2).sum() / per_sample
        elif self.loss == "l1":
            loss = error.abs().sum() / per_sample
        else:
            loss = F.huber_loss(outputs, targets, reduction="sum", delta=self.huber_delta) / per_sample
        detached = error.detach()
        row = stats_row(n, n, loss, detached.pow(2).sum() / per_sample, detached.abs().sum() / per_sample)
        return {"loss": loss, "stats": row}

    def preds(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return outputs.detach().float(), targets.float()

    def compute(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["samples"], 1.0)
        return {"loss": sums["loss"] / n, "mse": sums["squared_error"] / n, "mae": sums["absolute_error"] / n}


class LanguageModelTask(_Supervised):
    """Next-token cross-entropy: logits (B, T, V) against targets (B, T); `ignore_index` marks padding.

    `shift_labels`: true scores the logits at position t against the label at t + 1 (labels = input_ids, as
    HuggingFace's collators make them); false scores them at t (targets already shifted); auto shifts when the
    first batch's labels equal its `input_ids` wherever they are not ignored, and says so in the log.

    The loss, its gradient and every metric are per token: a step follows the gradient of the mean over
    all tokens of its global batch. Logs `loss` and `perplexity` per token, and tokens per second.
    """

    name = "language_model"
    unit = "token"
    fixed_units = False

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, target_key: str = "labels",
                 shift_labels: ShiftSetting = "auto") -> None:
        super().__init__(target_key)
        if not (isinstance(ignore_index, int) and not isinstance(ignore_index, bool)):
            raise ValueError(f"task.ignore_index={ignore_index!r} must be an integer (the target of padding)")
        if not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing < 1.0):
            raise ValueError(f"task.label_smoothing={label_smoothing} must be in [0, 1)")
        self.ignore_index, self.label_smoothing = ignore_index, float(label_smoothing)
        self.shift = LabelShift(shift_labels, ignore_index, "the logits at position t are scored against the "
                                "label at t + 1 (task.shift_labels=false scores them at t)")

    def forward(self, model: nn.Module, batch: Any, precision: Any, with_preds: bool) -> dict[str, Any]:
        self.shift.does(*split_batch(batch, self.target_key, self.name))  # decided before the scores need it
        return super().forward(model, batch, precision, with_preds)

    def align(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and the targets they are scored against: one position apart when the labels are shifted."""
        if logits.dim() != targets.dim() + 1 or logits.shape[:-1] != targets.shape or targets.is_floating_point():
            raise BatchError(f"task=language_model needs logits (B, T, V) and integer targets (B, T); the model "
                             f"returned {tuple(logits.shape)} for targets {tuple(targets.shape)} "
                             f"{str(targets.dtype).replace('torch.', '')}")
        if self.shift.decided and targets.dim() >= 2:
            return logits[:, :-1], LabelShift.shifted(targets)
        return logits, targets

    def score(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        n = len(targets)
        logits, targets = self.align(logits, targets)
        flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        loss = _cross_entropy(self.name, flat_logits, flat_targets, ignore_index=self.ignore_index, reduction="sum",
                              label_smoothing=self.label_smoothing)
        tokens = (flat_targets != self.ignore_index).sum()
        return {"loss": loss, "stats": stats_row(n, tokens, loss)}

    def preds(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Metrics see the scored tokens only: (M, V) logits and (M,) targets, padding removed."""
        logits, targets = self.align(logits, targets)
        flat_logits, flat_targets = logits.detach().float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
        keep = flat_targets != self.ignore_index
        return flat_logits[keep], flat_targets[keep]

    def units(self, batch: Any) -> Optional[int]:
        inputs, targets = split_batch(batch, self.target_key, self.name)
        if self.shift.does(inputs, targets) and targets.dim() >= 2:
            targets = LabelShift.shifted(targets)
        return int((targets != self.ignore_index).sum())

    def compute(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss"] / max(sums["units"], 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}


def _cross_entropy(task: str, logits: torch.Tensor, targets: torch.Tensor, **options: Any) -> torch.Tensor:
    """F.cross_entropy, with a class id the logits have no score for named as a settings mismatch (on the CPU)."""
    try:
        return F.cross_entropy(logits, targets, **options)
    except IndexError as error:  # "Target 7 is out of bounds."
        raise BatchError(f"task={task}: {str(error).rstrip('.')} for a model giving {logits.shape[-1]} scores per "
                         "sample: the model's number of classes (e.g. model.num_classes) must exceed every class id "
                         "of the data") from None
