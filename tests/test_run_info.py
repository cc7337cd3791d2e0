"""The start line that names what ran where (devices, backend, precision, world size, strategy), its record in
metrics.json and the hyperparameters, and the trainer's progress_bar key."""

from __future__ import annotations

from typing import Callable

import pytest
from omegaconf import DictConfig

from runner.checks import validate
from runner.config import ConfigError

MakeCfg = Callable[..., DictConfig]


@pytest.mark.parametrize("value", ["auto", "true", "false"])
def test_progress_bar_takes_auto_true_false(make_cfg: MakeCfg, value: str) -> None:
    validate(make_cfg(f"trainer.progress_bar={value}"))


def test_progress_bar_refuses_other_values(make_cfg: MakeCfg) -> None:
    with pytest.raises(ConfigError, match=r"trainer.progress_bar=maybe is not allowed: use auto .*, true or false"):
        validate(make_cfg("trainer.progress_bar=maybe"))
