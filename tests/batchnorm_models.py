"""Models with batch norm, named by `model._target_=batchnorm_models.<Name>` in tests (workers import it from tests/:
PYTHONPATH)."""

from __future__ import annotations

from torch import nn


class BNNet(nn.Module):
    """The MLP option's layers with a BatchNorm1d after each hidden Linear; takes the same keys as `model=mlp`."""

    def __init__(self, in_features: int = 32, hidden: int = 16, depth: int = 2, num_classes: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.BatchNorm1d(hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)
