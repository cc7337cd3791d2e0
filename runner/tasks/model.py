"""task=model: the model computes its own loss (HuggingFace style), the runner weighs and logs what it returns."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

from runner.tasks.base import BatchError, Task, as_mapping, call_model, describe, field, leading_size, stats_row

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
    units that mean is over (tokens, say; default the batch size); and other scalars, logged as metrics
    weighted by `count`. `unit` names what `count` counts, for `throughput/<unit>s_per_s` (`tokens` or `token`: tokens_per_s).

    Metrics in the `metrics` config get the output's `preds_key` entry and the batch's `target_key` entry.
    """

    name = "model"

    def __init__(self, unit: str = "sample", preds_key: str = "logits", target_key: str = "labels") -> None:
        if not (isinstance(unit, str) and unit.isidentifier()):
            raise ValueError(f"task.unit={unit!r} must be a name such as sample or token (what `count` counts)")
        self.unit, self.preds_key, self.target_key = unit, preds_key, target_key
        self._reports_count: Optional[bool] = None  # learnt from the first output
        self._names: Optional[tuple[str, ...]] = None

    @property
    def fixed_units(self) -> bool:
        return self._reports_count is False

    @property
    def extra_stats(self) -> tuple[str, ...]:  # type: ignore[override]
        return self._names or ()

    def units(self, batch: Any) -> Optional[int]:
        """The batch size once the model is known to report no `count`; None (ask the model) until then."""
        return leading_size(batch) if self._reports_count is False else None

    def forward(self, model: nn.Module, batch: Any, precision: Any, with_preds: Any) -> dict[str, Any]:
        with precision.forward_context():
            output = call_model(model, precision.convert_input(batch))
        loss, count, scalars = self._loss(output), field(output, "count"), _scalars(output)
        self._learn(count is not None, scalars)
        if count is None:
            count = leading_size(batch)
        elif isinstance(count, torch.Tensor) and count.numel() != 1:
            raise BatchError(f"task=model: the model returned a count of shape {tuple(count.shape)}; it must be "
                             "one number, how many units its loss is the mean over")
        loss_sum = loss.float() * count
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
        return {"loss": sums["loss"] / units, **{name: sums[name] / units for name in self._names or ()}}
