"""16-mixed and bf16-mixed precision: float32 parameters, forward under autocast, fp16 loss scaling."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer

from runner.precision.precision import Precision, cast_floats

_AUTOCAST_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
_DEVICE_TYPES = ("cpu", "cuda")


def _device_type(device: str) -> str:
    try:
        device_type = torch.device(device).type
    except RuntimeError:
        device_type = None
    if device_type not in _DEVICE_TYPES:
        allowed = ", ".join(repr(name) for name in _DEVICE_TYPES)
        raise ValueError(f"MixedPrecision got device={device!r}; allowed: {allowed}")
    return device_type


class MixedPrecision(Precision):
    """Parameters stay float32; the forward pass runs under torch.autocast in float16 or bfloat16.

    16-mixed scales the loss with a GradScaler so small float16 gradients do not flush to zero, and
    skips steps whose gradients overflowed. bf16-mixed has float32's range and needs no scaling: it
    holds a disabled GradScaler, so every hook takes the same path for both.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        device: str = "cuda",
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        super().__init__()
        if precision not in _AUTOCAST_DTYPES:
            allowed = ", ".join(repr(name) for name in _AUTOCAST_DTYPES)
            raise ValueError(f"MixedPrecision got precision={precision!r}; allowed: {allowed}")
        if precision == "bf16-mixed" and scaler is not None:
            raise ValueError(
                "MixedPrecision got a scaler with precision='bf16-mixed'; loss scaling is only for '16-mixed'"
            )
        self.precision = precision
        self.device = _device_type(device)
        self._autocast_dtype = _AUTOCAST_DTYPES[precision]
        if scaler is None:
            scaler = torch.amp.GradScaler(self.device, enabled=precision == "16-mixed")
        self.scaler = scaler
        # Optimizers unscaled since their last step: GradScaler rejects a second unscale_ in one step.
        self._unscaled: set[int] = set()

    @property
    def skips_nonfinite_steps(self) -> bool:  # type: ignore[override]
        return self.scaler.is_enabled()

    def forward_context(self) -> AbstractContextManager:
        # A new object per call: autocast state is thread-local and DataParallel replicas enter it in threads.
        return torch.autocast(device_type=self.device, dtype=self._autocast_dtype)

    def convert_output(self, data: Any) -> Any:
        return cast_floats(data, torch.float32)

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        self.scaler.scale(loss).backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if id(optimizer) in self._unscaled:
            return
        self.scaler.unscale_(optimizer)
        self._unscaled.add(id(optimizer))

    def optimizer_step(self, optimizer: Optimizer, update: bool = True) -> None:
        # GradScaler.step skips the update when the gradients hold inf/NaN; update() then lowers the scale.
        self.scaler.step(optimizer)
        if update:
            self.scaler.update()
        self._unscaled.discard(id(optimizer))

    def update_scale(self) -> None:
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # An empty state comes from a run without loss scaling: keep this scaler's fresh state.
        if state:
            self.scaler.load_state_dict(state)
