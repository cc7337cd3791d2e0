"""64-true precision: the model and its floating inputs in float64."""

from __future__ import annotations

import torch

from runner.precision.precision import Precision


class DoublePrecision(Precision):
    """64-true: parameters built and cast in float64, floating inputs cast to it, outputs back to float32."""

    precision: str = "64-true"
    _dtype = torch.float64
