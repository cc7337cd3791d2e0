"""16-true and bf16-true precision: the model and its floating inputs entirely in a half dtype."""

from __future__ import annotations

from typing import Literal

import torch

from runner.precision.precision import Precision

_HALF_DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16}


class HalfPrecision(Precision):
    """Parameters built and cast in float16/bfloat16, floating inputs cast to it, outputs back to float32.

    No master copy in float32 and no loss scaling: the optimizer updates the half parameters directly.
    """

    def __init__(self, precision: Literal["16-true", "bf16-true"]) -> None:
        super().__init__()
        if precision not in _HALF_DTYPES:
            allowed = ", ".join(repr(name) for name in _HALF_DTYPES)
            raise ValueError(f"HalfPrecision got precision={precision!r}; allowed: {allowed}")
        self.precision = precision
        self._dtype = _HALF_DTYPES[precision]
