"""Models for launcher tests, named by `model._target_=faulty.<Name>`: one fails on rank 1, one records its environment."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch
from torch import nn

# What a launched worker is promised in its environment (the launcher tests read these back).
PROBED_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                    "CUBLAS_WORKSPACE_CONFIG")


class FailOnRank1(nn.Module):
    """A linear classifier whose training forward fails on global rank 1 at its `fail_at_step`-th call.

    `how`: 'raise' (a Python exception) or 'kill' (the process dies from SIGKILL, as when out of memory).
    """

    def __init__(self, in_features: int = 32, num_classes: int = 4, fail_at_step: int = 3, how: str = "raise") -> None:
        super().__init__()
        if how not in ("raise", "kill"):
            raise ValueError(f"model.how={how!r} is not one of raise, kill")
        self.linear = nn.Linear(in_features, num_classes)
        self.fail_at_step, self.how = fail_at_step, how
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if os.environ.get("RANK") == "1" and self.calls >= self.fail_at_step:
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected failure at step {self.calls}")
        return self.linear(x)


class EnvProbe(nn.Module):
    """A linear classifier that writes the worker's launch variables to `<out_dir>/env_<RANK>.json` when built."""

    def __init__(self, out_dir: str, in_features: int = 32, num_classes: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)
        seen = {key: os.environ.get(key) for key in PROBED_VARIABLES}
        seen["torch_threads"] = torch.get_num_threads()
        Path(out_dir, f"env_{os.environ.get('RANK', 'none')}.json").write_text(json.dumps(seen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
