"""The module every strategy wraps: the user's model and loss, returning the loss and what the loop sums."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Columns of the per-batch statistics the loop sums (and reduces over processes at log steps).
LOSS_SUM, COUNT, CORRECT, HAS_CORRECT = range(4)


class TaskModule(nn.Module):
    """forward(inputs, targets) -> {"loss": batch mean, "stats": (1, 4) [loss_sum, count, correct, has_correct]}.

    Sums rather than means, so the loop weights every sample equally whatever the split. Precision's
    autocast is entered here, inside forward, because autocast is thread-local and DataParallel runs
    its replicas in threads.
    """

    def __init__(self, model: nn.Module, loss_fn: nn.Module, precision: Any) -> None:
        super().__init__()
        self.model, self.loss_fn, self.precision = model, loss_fn, precision

    def forward(self, inputs: Any, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        inputs = self.precision.convert_input(inputs)
        with self.precision.forward_context():
            outputs = self.model(inputs)
            loss = self.loss_fn(self.precision.convert_output(outputs), targets)
        count = float(targets.shape[0])
        loss_sum = loss.detach().float().reshape(1) * count
        if outputs.ndim == 2 and targets.ndim == 1 and not targets.is_floating_point():
            correct = (outputs.detach().argmax(dim=1) == targets).sum().reshape(1).to(loss_sum.dtype)
            stats = torch.cat((loss_sum, loss_sum.new_tensor((count,)), correct, loss_sum.new_tensor((1.0,))))
        else:
            stats = torch.cat((loss_sum, loss_sum.new_tensor((count, 0.0, 0.0))))
        return {"loss": loss, "stats": stats.reshape(1, 4)}

    @staticmethod
    def batch_loss(out: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss to back-propagate: the batch mean, also when DataParallel gathered one mean per device."""
        loss = out["loss"]
        if loss.dim() == 0:
            return loss
        counts = out["stats"][:, COUNT]
        return (loss * counts).sum() / counts.sum()
