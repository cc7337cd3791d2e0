"""Accelerators: which devices a run can use and how to address them."""

from runner.accelerators.accelerator import Accelerator, CPUAccelerator, CUDAAccelerator, auto_accelerator

__all__ = ["Accelerator", "CPUAccelerator", "CUDAAccelerator", "auto_accelerator"]
