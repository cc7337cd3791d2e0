"""CPU and CUDA accelerators: device discovery, device parsing and per-process device set-up."""

from __future__ import annotations

import os
from typing import Sequence, Union

import torch

Devices = Union[int, str, Sequence[int]]


class Accelerator:
    """The hardware a strategy runs on. `device_type` is what `torch.device` and `torch.autocast` take."""

    device_type: str = "cpu"

    def is_available(self) -> bool:
        raise NotImplementedError

    def auto_device_count(self) -> int:
        raise NotImplementedError

    def parse_devices(self, devices: Devices) -> list[int]:
        """Turn `trainer.devices` (int, -1, 'auto' or a list of indices) into a list of device indices."""
        if isinstance(devices, str):
            if devices == "auto":
                return list(range(self.auto_device_count()))
            devices = int(devices)
        if isinstance(devices, int):
            count = self.auto_device_count() if devices == -1 else devices
            return list(range(count))
        return [int(d) for d in devices]

    def get_parallel_devices(self, devices: Devices) -> list[torch.device]:
        return [torch.device(self.device_type, i) for i in self.parse_devices(devices)]

    def setup_device(self, device: torch.device) -> None:
        """Make `device` the current one for this process."""

    def teardown(self) -> None:
        """Release what the accelerator holds (nothing on CPU)."""


class CPUAccelerator(Accelerator):
    device_type = "cpu"

    def is_available(self) -> bool:
        return True

    def auto_device_count(self) -> int:
        # One CPU "device" per process; more processes are asked for explicitly with trainer.devices.
        return 1

    def get_parallel_devices(self, devices: Devices) -> list[torch.device]:
        return [torch.device("cpu")] * len(self.parse_devices(devices))


class CUDAAccelerator(Accelerator):
    device_type = "cuda"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def auto_device_count(self) -> int:
        return torch.cuda.device_count()

    def setup_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def teardown(self) -> None:
        torch.cuda.empty_cache()


def auto_accelerator() -> Accelerator:
    """`accelerator=auto`: CUDA when a GPU is visible, else CPU."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return CPUAccelerator()
    return CUDAAccelerator() if torch.cuda.is_available() else CPUAccelerator()
