"""Models of a user's that fail on purpose, named by `model._target_=user_models.<Name>`: a constructor that refuses
its settings, a forward that raises within the user's own helper, for the tests of what the user sees."""

from __future__ import annotations

import torch
from torch import nn


class RefusesItsSettings(nn.Module):
    def __init__(self, in_features: int = 8, hidden: int = 16, depth: int = 1, num_classes: int = 4) -> None:
        super().__init__()
        raise ValueError(f"hidden={hidden} is not a size this model builds")


def _helper(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError(f"the user's helper cannot take a batch of {x.shape[0]}")


class FailsInForward(nn.Module):
    """A linear classifier whose training forward fails at its `at`-th call, in a helper of its module."""

    def __init__(self, in_features: int = 8, hidden: int = 16, depth: int = 1, num_classes: int = 4,
                 at: int = 2) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                return _helper(x)
        return self.linear(x)
