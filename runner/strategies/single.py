"""One process on one device."""

from __future__ import annotations

from typing import Optional, Union

import torch

from runner.accelerators import Accelerator
from runner.checkpoint_io import CheckpointIO
from runner.precision import Precision
from runner.strategies.strategy import Strategy


class SingleDeviceStrategy(Strategy):
    def __init__(
        self,
        device: Union[str, torch.device] = "cpu",
        accelerator: Optional[Accelerator] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self._device = torch.device(device)

    @property
    def root_device(self) -> torch.device:
        return self._device
