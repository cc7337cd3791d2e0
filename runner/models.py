"""Built-in models for smoke tests, CI overrides and benchmarks."""

from __future__ import annotations

from torch import nn


class MLP(nn.Module):
    """`depth` hidden layers of width `hidden` with ReLU, then a linear classifier over `num_classes`."""

    def __init__(self, in_features: int = 32, hidden: int = 128, depth: int = 2, num_classes: int = 4) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("hidden", hidden), ("num_classes", num_classes)):
            if value < 1:
                raise ValueError(f"model.{name}={value} must be a positive integer")
        if depth < 0:
            raise ValueError(f"model.depth={depth} must be 0 (a linear model) or more")
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)
