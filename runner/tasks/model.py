"""task=model: the model computes its own loss (HuggingFace style), the runner weighs and logs what it returns."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
from torch import nn

from runner.tasks.base import (BatchError, Task, as_mapping, call_model, describe, field, leading_size, plural,
                               stats_row)
from runner.tasks.shift import LabelShift, ShiftSetting

_RESERVED = ("loss", "count")


def _scalars(output: Any) -> dict[str, Any]:
    """The scalar entries of a model output (0-dim tensors and numbers), other than `loss` and `count`."""
    items = output if isinstance(output, Mapping) else getattr(output, "__dict__", {})
    return {str(k): v for k, v in items.items() if k not in _RESERVED and (
        (isinstance(v, torch.Tensor) and v.dim() == 0)
        or (isinstance(v, (int, float)) and not isinstance(v, bool)))}


class ModelTask(Task):
    """Calls `model(**batch)` for a dict batch and `model(batch)` otherwise. The model returns a dict (or an
    object with attributes) holding `loss`, the mean over the batch's units; optionally `count`, how many
    units that mean is over; and other scalars, logged as metrics weighted by `count`.

    `unit` names the units, for `throughput/<unit>s_per_s`. Without a `count` from the model: `sample` counts
    the batch's samples; `token` counts the batch's `target_key` labels (B, T) that are not `ignore_index`,
    after the shift a causal LM applies inside (`shift_labels`, as for task=language_model: auto takes labels
    equal to `input_ids` as the HuggingFace convention, scored from the second position on), and logs
    `perplexity`; any other unit needs the model's `count`.

    Metrics in the `metrics` config get the output's `preds_key` entry and the batch's `target_key` entry.
    """

    name = "model"

    def __init__(self, unit: str = "sample", preds_key: str = "logits", target_key: str = "labels",
                 ignore_index: int = -100, shift_labels: ShiftSetting = "auto") -> None:
        if not (isinstance(unit, str) and unit.isidentifier()):
            raise ValueError(f"task.unit={unit!r} must be a name such as sample or token (what `count` counts)")
        if not (isinstance(ignore_index, int) and not isinstance(ignore_index, bool)):
            raise ValueError(f"task.ignore_index={ignore_index!r} must be an integer (the label of padding)")
        self.unit, self.preds_key, self.target_key, self.ignore_index = unit, preds_key, target_key, ignore_index
        self.shift = LabelShift(shift_labels, ignore_index, "the model shifts them inside, so the tokens counted "
                                "are the labels from the second position on (task.shift_labels=false counts all)")
        self._reports_count: Optional[bool] = None  # learnt from the first output
        self._names: Optional[tuple[str, ...]] = None

    @property
    def fixed_units(self) -> bool:
        return self._reports_count is False and plural(self.unit) == "samples"

    @property
    def extra_stats(self) -> tuple[str, ...]:  # type: ignore[override]
        return self._names or ()

    def units(self, batch: Any) -> Optional[int]:
        """Once the model is known to report no `count`: its samples, or its tokens; None (ask the model) until then."""
        return int(self._count(batch)) if self._reports_count is False else None

    def forward(self, model: nn.Module, batch: Any, precision: Any, with_preds: Any) -> dict[str, Any]:
        with precision.forward_context():
            output = call_model(model, precision.convert_input(batch))
        loss, count, scalars = self._loss(output), field(output, "count"), _scalars(output)
        self._learn(count is not None, scalars)
        if count is None:
            count = self._count(batch)
        elif isinstance(count, torch.Tensor) and count.numel() != 1:
            raise BatchError(f"task=model: the model returned a count of shape {tuple(count.shape)}; it must be "
                             "one number, how many units its loss is the mean over")
        loss_sum = loss.float() * count  # the model's mean over its units, weighted by how many: a sum
        row = stats_row(leading_size(batch), count, loss_sum, *(torch.as_tensor(scalars[name], dtype=torch.float32,
                        device=loss.device) * count for name in self._names or ()))
        out = {"loss": loss_sum, "stats": row}
        if with_preds:
            try:
                out["preds"], out["target"] = self._preds(output, batch)
            except BatchError:
                if with_preds is True:  # not for a trial of the validation metrics ("if given")
                    raise  # a model may leave its logits out when training
        return out

    def _count(self, batch: Any) -> Union[int, torch.Tensor]:
        """The units of a batch whose model reports no `count`: its samples, or its labels' scored tokens."""
        if plural(self.unit) == "samples":
            return leading_size(batch)
        fields = as_mapping(batch)
        labels = fields.get(self.target_key) if fields is not None else None
        if plural(self.unit) != "tokens":
            raise BatchError(f"task.unit={self.unit}: the model returned no 'count', and only samples and tokens "
                             "are counted without one; return 'count' from the model, or use task.unit=sample or "
                             "token")
        if not (isinstance(labels, torch.Tensor) and labels.dim() >= 2 and not labels.is_floating_point()):
            found = f"the batch's {self.target_key!r} is {describe(labels)}" if fields is not None else \
                f"the batch is {describe(batch)}"
            raise BatchError(f"task.unit={self.unit}: the model returned no 'count' and {found}, so its units cannot "
                             f"be counted (tokens are counted from integer labels (B, T) under task.target_key); "
                             f"return 'count' from the model, or use task.unit=sample")
        if self.shift.does(fields, labels):
            labels = LabelShift.shifted(labels)
        return (labels != self.ignore_index).sum()

    def _loss(self, output: Any) -> torch.Tensor:
        loss = None if isinstance(output, torch.Tensor) else field(output, "loss")
        if not isinstance(loss, torch.Tensor):
            raise BatchError(f"task=model: the model returned {describe(output)} without a 'loss' tensor; return a "
                             "dict (or an object) with 'loss', the mean over the batch (a model returning logits "
                             "runs under task=classification or task=language_model)")
        if loss.dim() != 0:
            raise BatchError(f"task=model: the model's loss has shape {tuple(loss.shape)}; it must be a scalar, the "
                             "mean over the batch's units (return 'count' to say how many)")
        return loss

    def _learn(self, reports_count: bool, scalars: dict[str, Any]) -> None:
        """The first output fixes which metrics there are; every process and step must return the same."""
        names = tuple(sorted(scalars))
        if self._names is None:
            self._reports_count, self._names = reports_count, names
        elif (reports_count, names) != (self._reports_count, self._names):
            raise BatchError(f"task=model: the model returned count={reports_count} and scalars {list(names)} after "
                             f"count={self._reports_count} and {list(self._names)} before; return the same every step")

    def _preds(self, output: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        preds = field(output, self.preds_key)
        fields = as_mapping(batch)
        target = fields.get(self.target_key) if fields is not None else None
        if not (isinstance(preds, torch.Tensor) and isinstance(target, torch.Tensor)):
            raise BatchError(f"task=model: metrics get the model output's {self.preds_key!r} (task.preds_key) and "
                             f"the batch's {self.target_key!r} (task.target_key); the output is {describe(output)} "
                             f"and the batch {describe(batch)}")
        return preds.detach().float(), target

    def compute(self, sums: dict[str, float]) -> dict[str, float]:
        units = max(sums["units"], 1.0)
        values = {"loss": sums["loss"] / units, **{name: sums[name] / units for name in self._names or ()}}
        if plural(self.unit) == "tokens" and "perplexity" not in values:  # a loss per token: its perplexity too
            values["perplexity"] = math.exp(min(values["loss"], 700.0))
        return values
