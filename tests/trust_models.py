"""Models for the launcher's trust tests, named by `model._target_=trust_models.<Name>`: one rank stalls or fails."""

from __future__ import annotations

import atexit
import os
import signal
import time

import torch
from torch import nn

from runner.tasks import BatchError


class _OnRank(nn.Module):
    """A linear classifier that does something to one rank at its `at_step`-th training forward."""

    def __init__(self, in_features: int = 32, num_classes: int = 4, rank: int = 1, at_step: int = 3) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)
        self.rank, self.at_step = rank, at_step
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if os.environ.get("RANK") == str(self.rank) and self.calls == self.at_step:
                self.happen()
        return self.linear(x)

    def happen(self) -> None:
        raise NotImplementedError


class SleepOnRank(_OnRank):
    """The rank stops in its step, as a deadlock or a hung read would leave it; the others wait in the reduction."""

    def happen(self) -> None:
        time.sleep(3600)  # the stall


class BatchErrorOnRank(_OnRank):
    """The rank fails with an error the runner reports as a line (a batch the task cannot take)."""

    def happen(self) -> None:
        raise BatchError(f"the batch of step {self.calls} has no labels (injected on rank {self.rank})")


class SignalsItselfAtExit(nn.Module):
    """A linear classifier whose process of rank `rank` is sent SIGTERM, then SIGSTOP, as it exits after the run (the
    model is built in every worker): a signal that comes once the run is done."""

    def __init__(self, in_features: int = 32, num_classes: int = 4, rank: int = 1) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)
        if os.environ.get("RANK") == str(rank):
            atexit.register(os.kill, os.getpid(), signal.SIGSTOP)  # the exit handlers run last in, first out
            atexit.register(os.kill, os.getpid(), signal.SIGTERM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
