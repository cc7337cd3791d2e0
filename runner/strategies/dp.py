"""Single-process data parallel training: torch.nn.DataParallel replicates the model over the CUDA devices."""

from __future__ import annotations

import warnings
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.nn import DataParallel

from runner.accelerators import Accelerator
from runner.checkpoint_io import CheckpointIO
from runner.precision import Precision
from runner.strategies import sync_batchnorm
from runner.strategies.strategy import Strategy, move_to_device
from runner.tree import apply_to_tensors

# DataParallel says this on every step whose outputs are 0-dim; one value per device is what we want.
_SCALAR_GATHER_WARNING = "Was asked to gather along dimension 0, but all input tensors were scalars"


class DataParallelStrategy(Strategy):
    """One process; each step scatters the batch over `parallel_devices` and gathers one output per device.

    With a single device (the CPU included) the module runs unwrapped, as under SingleDeviceStrategy.
    """

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[Union[torch.device, str]]] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision_plugin)
        devices = [torch.device(d) for d in parallel_devices or ["cpu"]]
        if len(devices) > 1 and any(d.type != "cuda" for d in devices):
            names = ", ".join(str(d) for d in devices)
            raise ValueError(
                f"strategy=dp got parallel_devices=[{names}] (trainer.devices={len(devices)}): DataParallel over "
                "several devices needs CUDA devices only (accelerator=cuda); use strategy=ddp to run on CPU"
            )
        self.parallel_devices = devices
        self.model: Optional[nn.Module] = None

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0]

    @property
    def precision_plugin(self) -> Precision:
        return self.precision

    # -- set-up ---------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        """Place and wrap `trainer.model`; the wrapped module is kept as `self.model`."""
        self.model = trainer.model
        self.model_to_device()
        self.setup_module(self.model)

    def model_to_device(self) -> None:
        if self.model is None:
            raise RuntimeError("DataParallelStrategy.model_to_device() has no model: call setup(trainer) first")
        self.module_to_device(self.model)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Wrap in DataParallel on CUDA; DataParallel on the CPU would only add a layer that does nothing."""
        sync_batchnorm.warn_per_device(module, len(self.parallel_devices))
        if self.root_device.type == "cuda":
            module = DataParallel(
                module,
                device_ids=[d.index for d in self.parallel_devices],
                output_device=self.root_device.index,
            )
        self.model = module
        return module

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, DataParallel) else module

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        # DataParallel scatters from the root device, so the whole batch goes there first.
        return move_to_device(batch, device or self.root_device)

    # -- steps: all of them run on every device -------------------------------------------------
    def training_step(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _run(module, *args, **kwargs)

    def validation_step(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _run(module, *args, **kwargs)

    def test_step(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _run(module, *args, **kwargs)

    def predict_step(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _run(module, *args, **kwargs)

    # -- collectives: one process, so only the per-device values need combining ----------------
    def reduce(self, collection: Any, *args: Any, **kwargs: Any) -> Any:
        """Mean of each tensor's per-device values, keeping the collection's structure; `args` are ignored."""
        return apply_to_tensors(collection, _mean)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return bool(decision)

    def teardown(self) -> None:
        # Give the devices' memory back; the module stays usable on the CPU.
        if self.model is not None:
            self.model.to("cpu")
        super().teardown()


def _run(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SCALAR_GATHER_WARNING)
        return module(*args, **kwargs)


def _mean(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() == 0:
        return tensor
    return (tensor if tensor.is_floating_point() else tensor.float()).mean()
