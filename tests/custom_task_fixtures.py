"""A task of one's own, named by `task._target_=custom_task_fixtures.ContrastiveTask`, and pair data for it."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from runner.tasks import Task
from runner.tasks.base import stats_row


def contrastive_losses(z1: torch.Tensor, z2: torch.Tensor, same: torch.Tensor, margin: float) -> torch.Tensor:
    """Each pair's contrastive loss (Hadsell et al.): d^2 for a similar pair, max(0, margin - d)^2 for another."""
    distance = F.pairwise_distance(z1, z2)
    return same * distance.pow(2) + (1 - same) * F.relu(margin - distance).pow(2)


class ContrastiveTask(Task):
    """Batches (x1, x2, same): the model embeds both sides; logs `loss` and `distance`, each a mean per pair."""

    name = "contrastive"
    extra_stats = ("distance",)

    def __init__(self, margin: float = 1.0) -> None:
        if not (isinstance(margin, (int, float)) and margin > 0):
            raise ValueError(f"task.margin={margin!r} must be a positive number")
        self.margin = float(margin)

    def forward(self, model: nn.Module, batch: Any, precision: Any, with_preds: bool) -> dict[str, Any]:
        (x1, x2), same = precision.convert_input((batch[0], batch[1])), batch[2]
        with precision.forward_context():
            z1, z2 = model(x1), model(x2)
            loss = contrastive_losses(z1.float(), z2.float(), same, self.margin).sum()  # a sum over the pairs
        n = len(same)
        return {"loss": loss, "stats": stats_row(n, n, loss, F.pairwise_distance(z1, z2).detach().sum())}

    def units(self, batch: Any) -> Optional[int]:
        return len(batch[0])

    def compute(self, sums: dict[str, float]) -> dict[str, float]:
        pairs = max(sums["samples"], 1.0)
        return {"loss": sums["loss"] / pairs, "distance": sums["distance"] / pairs}


class Pairs:
    """Pairs of points around `clusters` random centres; `same` is 1.0 when both come from the same centre."""

    def __init__(self, num_samples: int = 128, val_samples: int = 37, num_features: int = 8, clusters: int = 3,
                 batch_size: int = 16, seed: int = 0) -> None:
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(seed)
        centres = 2 * torch.randn(clusters, num_features, generator=generator)

        def make(n: int) -> TensorDataset:
            a, b = (torch.randint(0, clusters, (n,), generator=generator) for _ in range(2))
            b = torch.where(torch.rand(n, generator=generator) < 0.5, a, b)  # about half the pairs similar
            x1 = centres[a] + torch.randn(n, num_features, generator=generator)
            x2 = centres[b] + torch.randn(n, num_features, generator=generator)
            return TensorDataset(x1, x2, (a == b).float())

        self.train_dataset, self.val_dataset = make(num_samples), make(val_samples)


class TwoLossesTask(Task):
    """Classification with one loss per named optimizer: `hidden` gets `weight` x the cross entropy, `classifier` the
    cross entropy itself (with SGD, as if the hidden layers' rate were `weight` times theirs)."""

    name = "two_losses"
    losses_per_optimizer = True

    def __init__(self, weight: float = 2.0) -> None:
        self.weight = weight

    def forward(self, model: nn.Module, batch: Any, precision: Any, with_preds: bool) -> dict[str, Any]:
        x, y = batch
        loss = F.cross_entropy(model(x), y, reduction="sum")
        return {"loss": {"hidden": loss * self.weight, "classifier": loss},
                "stats": stats_row(len(y), len(y), loss)}

    def units(self, batch: Any) -> Optional[int]:
        return len(batch[1])

    def compute(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["loss"] / sums["units"]}
