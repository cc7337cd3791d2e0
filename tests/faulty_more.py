"""Fixtures for tests/test_reliability_more.py, named by `model._target_=faulty_more.<Name>` or `data._target_=...`:
an evaluation that is slow, data modules whose hooks exit, raise or hang, a model whose first forward hangs."""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

from runner.data import SyntheticClassification


class SlowEval(nn.Module):
    """A linear classifier that sleeps `delay` seconds per evaluation batch (validation, test, predict)."""

    def __init__(self, in_features: int = 32, num_classes: int = 4, delay: float = 1.0, **ignored) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            time.sleep(self.delay)
        return self.linear(x)


class HangFirstForward(nn.Module):
    """A linear classifier whose first training forward never returns on global rank `rank`."""

    def __init__(self, in_features: int = 32, num_classes: int = 4, rank: int = 1, **ignored) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and os.environ.get("RANK", "0") == str(self.rank):
            time.sleep(3600)
        return self.linear(x)


class Hooks(SyntheticClassification):
    """Synthetic data as a data module whose `hook` (prepare_data or setup) does `what` on global rank `rank`
    (-1: every rank): 'exit' (sys.exit(0), as a library helper may), 'raise', or 'hang' (never returns)."""

    def __init__(self, hook: str = "prepare_data", what: str = "exit", rank: int = -1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hook, self.what, self.rank = hook, what, rank

    def _misbehave(self, hook: str) -> None:
        if hook != self.hook or self.rank not in (-1, int(os.environ.get("RANK", "0"))):
            return
        if self.what == "exit":
            sys.exit(0)
        if self.what == "raise":
            raise ValueError(f"injected failure in {hook}")
        time.sleep(3600)

    def prepare_data(self) -> None:
        self._misbehave("prepare_data")

    def setup(self, stage: str) -> None:
        self._misbehave("setup")
