"""Full float32 precision: the base precision plugin that the training loop talks to."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from runner.tree import apply_to_tensors


def cast_floats(data: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor in nested lists, tuples, namedtuples and dicts to `dtype`.

    Integer tensors (class labels, indices) and non-tensor leaves pass through untouched, and every
    container comes back as the same type it went in as.
    """
    return apply_to_tensors(data, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor)


def tf32_settings() -> tuple[str, bool]:
    """(torch's float32 matmul precision: "highest" or "high" (TF32), whether cuDNN convolutions may use TF32)."""
    return torch.get_float32_matmul_precision(), bool(torch.backends.cudnn.allow_tf32)


def set_tf32_settings(settings: tuple[str, bool]) -> None:
    # torch's one switch for every backend: per-backend flags (fp32_precision) would make the
    # backend-wide query that inductor and other code read raise.
    torch.set_float32_matmul_precision(settings[0])
    torch.backends.cudnn.allow_tf32 = settings[1]


class Precision:
    """32-true: parameters, inputs and outputs stay float32; every hook is the plain fp32 action.

    Subclasses that compute in another dtype set `_dtype`; the module is then built and cast in it
    and floating inputs are cast to it, while outputs come back as float32.
    """

    precision: str = "32-true"
    _dtype: torch.dtype | None = None
    skips_nonfinite_steps: bool = False  # True where optimizer_step itself skips steps with inf/NaN gradients

    def __init__(self, tf32: bool = True) -> None:
        """`tf32` (32-true on CUDA): float32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa
        inputs, float32 accumulation), as Lightning recommends; False keeps them in full float32."""
        if not isinstance(tf32, bool):
            raise ValueError(f"precision.tf32={tf32!r} must be true or false")
        self.tf32 = tf32
        self._tf32_before: tuple | None = None  # the process's settings to put back at teardown
        # Default dtype to put back if a module_init_context is still open at teardown.
        self._dtype_before_init: torch.dtype | None = None

    def setup(self, device: torch.device) -> None:
        """Once the process has its device: 32-true on CUDA sets TF32 on or off (a process-wide setting)."""
        if device.type != "cuda" or self.precision != "32-true" or self._tf32_before is not None:
            return
        self._tf32_before = tf32_settings()
        set_tf32_settings(("high", True) if self.tf32 else ("highest", False))

    def module_init_context(self) -> AbstractContextManager:
        """Context in which the model is constructed, so its parameters are born in the compute dtype."""
        return nullcontext() if self._dtype is None else self._default_dtype(self._dtype)

    @contextmanager
    def _default_dtype(self, dtype: torch.dtype) -> Iterator[None]:
        previous = torch.get_default_dtype()
        outermost = self._dtype_before_init is None
        if outermost:
            self._dtype_before_init = previous
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)
            if outermost:
                self._dtype_before_init = None

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast the module's floating parameters and buffers to the compute dtype."""
        return module if self._dtype is None else module.to(self._dtype)

    def convert_input(self, data: Any) -> Any:
        """Cast the floating tensors of a batch to the compute dtype; integer tensors stay as they are."""
        return data if self._dtype is None else cast_floats(data, self._dtype)

    def convert_output(self, data: Any) -> Any:
        """Cast floating outputs to float32 so losses and metrics accumulate in float32."""
        return data if self._dtype is None else cast_floats(data, torch.float32)

    def forward_context(self) -> AbstractContextManager:
        """A fresh context around the forward pass (thread-local state such as autocast lives in it)."""
        return nullcontext()

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """`loss.backward(*args, **kwargs)` (retain_graph=, inputs=, as a manual step may pass them)."""
        loss.backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Bring gradients to their true scale before clipping; nothing to do without loss scaling."""

    def optimizer_step(self, optimizer: Optimizer, update: bool = True) -> None:
        """Step `optimizer`; `update=False` leaves the loss scale as it is, for a step of several optimizers that
        calls update_scale() once after the last."""
        optimizer.step()

    def update_scale(self) -> None:
        """After a step of several optimizers: the loss scaler's one update (nothing without loss scaling)."""

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state (the loss scaler's); plain numbers only, so weights_only loading works."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`. Without a loss scaler any saved scaler state is ignored, which lets a
        run resume under a different precision."""

    def teardown(self) -> None:
        """Put back the TF32 settings, and the default dtype if the loop stopped while a module_init_context was
        open."""
        if self._tf32_before is not None:
            set_tf32_settings(self._tf32_before)
            self._tf32_before = None
        if self._dtype_before_init is not None:
            torch.set_default_dtype(self._dtype_before_init)
            self._dtype_before_init = None
