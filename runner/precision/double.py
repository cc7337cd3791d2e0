"""64-true precision: the model and its floating inputs in float64."""

from __future__ import annotations

from typing import Any

import torch

from runner.precision.precision import Precision


class DoublePrecision(Precision):
    """64-true: parameters built and cast in float64, floating inputs cast to it, and the outputs kept in it: the
    loss, its gradient and the logged statistics are float64 end to end (a cast to float32 before the loss would
    round every gradient to float32's 7 digits)."""

    precision: str = "64-true"
    _dtype = torch.float64

    def convert_output(self, data: Any) -> Any:
        return data
