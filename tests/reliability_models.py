"""Models that misbehave on purpose, named by `model._target_=reliability_models.<Name>` in reliability tests."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn


class _Linear(nn.Module):
    """A linear classifier; takes (and ignores) the MLP option's other keys so `model._target_=` can swap it in."""

    def __init__(self, in_features: int = 32, num_classes: int = 4, hidden: int = 0, depth: int = 0) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            self.misbehave()
        return self.linear(x)

    def misbehave(self) -> None:
        pass


class FailOnce(_Linear):
    """Raises on rank 1 at its `fail_at_step`-th training call, once per `marker` file (for restart tests)."""

    def __init__(self, marker: str, fail_at_step: int = 5, **kwargs) -> None:
        super().__init__(**kwargs)
        self.marker, self.fail_at_step = Path(marker), fail_at_step

    def misbehave(self) -> None:
        if os.environ.get("RANK", "0") == "1" and self.calls == self.fail_at_step and not self.marker.exists():
            self.marker.write_text("failed once")
            raise RuntimeError("injected failure, once")


class NaNAt(_Linear):
    """Its output is NaN at the `nan_at_step`-th training call."""

    def __init__(self, nan_at_step: int = 3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.nan_at_step = nan_at_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * float("nan") if self.training and self.calls == self.nan_at_step else out


class Slow(_Linear):
    """Sleeps `delay` seconds per training call; rank `stall_rank` sleeps `stall` seconds at call `stall_at`."""

    def __init__(self, delay: float = 0.01, stall_rank: int = -1, stall_at: int = 0, stall: float = 0.0,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.delay, self.stall_rank, self.stall_at, self.stall = delay, stall_rank, stall_at, stall

    def misbehave(self) -> None:
        time.sleep(self.delay)
        if int(os.environ.get("RANK", "0")) == self.stall_rank and self.calls == self.stall_at:
            time.sleep(self.stall)


class SlowFinalValidation(_Linear):
    """A linear classifier whose validation after its `steps`-th training call touches `marker` (the test's cue),
    then takes `delay` seconds a batch."""

    def __init__(self, marker: str = "", steps: int = 2, delay: float = 0.5, **kwargs) -> None:
        super().__init__(**kwargs)
        self.marker, self.steps, self.delay, self.trained = marker, steps, delay, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            self.trained += self.training
            if not self.training and self.trained >= self.steps:
                Path(self.marker).touch()
                time.sleep(self.delay)
        return self.linear(x)


class _NaNGradient(torch.autograd.Function):
    """The identity forward; NaN gradients backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class NaNGradientAt(_Linear):
    """A finite output and loss at the `nan_at_step`-th training call, but NaN gradients from it."""

    def __init__(self, nan_at_step: int = 3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.nan_at_step = nan_at_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return _NaNGradient.apply(out) if self.training and self.calls == self.nan_at_step else out


class ReadsValues(_Linear):
    """Reads a value of its input with .item(), as HuggingFace's models do: the meta device cannot run it."""

    def misbehave(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max().item() > 1e9:  # a guard on the values, as a user's model may have
            raise ValueError("inputs out of range")
        return self.linear(x)
