"""The module every strategy wraps: the user's model and loss, returning what the loop sums per batch."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TaskModule(nn.Module):
    """forward(inputs, targets) -> {"loss_sum", "count"[, "correct"]}, each of shape (1,).

    Summed values rather than means, so the loop weights every sample equally whatever the batch split
    (DataParallel gathers one value per device; the loop sums them). Precision's autocast is entered here,
    inside forward, because autocast is thread-local and DataParallel runs its replicas in threads.
    """

    def __init__(self, model: nn.Module, loss_fn: nn.Module, precision: Any) -> None:
        super().__init__()
        self.model, self.loss_fn, self.precision = model, loss_fn, precision

    def forward(self, inputs: Any, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        inputs = self.precision.convert_input(inputs)
        with self.precision.forward_context():
            outputs = self.model(inputs)
            loss = self.loss_fn(self.precision.convert_output(outputs), targets)
        count = torch.full((1,), targets.shape[0], dtype=torch.float32, device=loss.device)
        result = {"loss_sum": loss.float().reshape(1) * count, "count": count}
        if outputs.ndim == 2 and targets.ndim == 1 and not targets.is_floating_point():
            result["correct"] = (outputs.detach().argmax(dim=1) == targets).sum().reshape(1).float()
        return result
