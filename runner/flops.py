"""The model's FLOPs per sample, counted once on the meta device, and the GPUs' peak rates that turn them into MFU."""

from __future__ import annotations

import copy
import logging
import re
import sys
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

from runner.tree import apply_to_tensors

log = logging.getLogger("runner")

# Dense peak TFLOP/s per GPU by the matrix units' input type, from the vendors' datasheets. The datasheets print the
# tensor-core figures "with sparsity" (marked *), twice the dense rate: those are halved here. FP32 is the non-tensor
# rate. A GPU missing here (or a type it lacks) gets no MFU unless `trainer.peak_tflops` gives its peak.
PEAK_TFLOPS: list[tuple[str, str, dict[str, float]]] = [
    # NVIDIA H200 datasheet: H200 NVL: FP32 60, TF32 Tensor Core 835*, BF16/FP16 Tensor Core 1,671*.
    (r"h200 nvl", "H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    # NVIDIA H200 datasheet: H200 SXM: FP32 67, TF32 Tensor Core 989*, BF16/FP16 Tensor Core 1,979*.
    (r"h200", "H200 SXM", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    # NVIDIA H100 datasheet: H100 NVL: FP32 60, TF32 Tensor Core 835*, BF16/FP16 Tensor Core 1,671*.
    (r"h100 nvl", "H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    # NVIDIA H100 datasheet: H100 PCIe: FP32 51, TF32 Tensor Core 756*, BF16/FP16 Tensor Core 1,513*.
    (r"h100.*pcie", "H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5}),
    # NVIDIA H100 datasheet: H100 SXM: FP32 67, TF32 Tensor Core 989*, BF16/FP16 Tensor Core 1,979* ("H100 80GB HBM3").
    (r"h100", "H100 SXM", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    # NVIDIA A100 datasheet (SXM and PCIe alike): FP32 19.5, TF32 156 (312*), BF16/FP16 312 (624*).
    (r"a100", "A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    # NVIDIA L40S datasheet: FP32 91.6, TF32 183 (366*), BF16/FP16 362.05 (733*).
    (r"l40s", "L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05}),
    # NVIDIA L4 datasheet: FP32 30.3, TF32 120*, BF16/FP16 242*.
    (r"\bl4\b", "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    # NVIDIA A10 datasheet: FP32 31.2, TF32 62.5 (125*), BF16/FP16 125 (250*). Not the A10G: NVIDIA publishes no
    # datasheet for it, so it is left out rather than guessed.
    (r"\ba10\b", "A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    # NVIDIA Ada GPU architecture whitepaper, RTX 4090: FP32 82.6, TF32 82.6 (165.2*), BF16 165.2 (330.4*),
    # FP16 with FP32 accumulate (what autocast training uses) 165.2 (330.4*).
    (r"rtx 4090", "RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    # NVIDIA Ampere GA102 whitepaper, RTX 3090: FP32 35.6, TF32 35.6 (71*), BF16 71 (142*), FP16 with FP32
    # accumulate 71 (142*).
    (r"rtx 3090", "RTX 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
    # NVIDIA V100 datasheet: SXM2: FP32 15.7, Tensor Performance 125; PCIe: FP32 14, Tensor 112 (FP16 only).
    (r"v100.*sxm", "V100 SXM2", {"fp32": 15.7, "fp16": 125.0}),
    (r"v100.*pcie", "V100 PCIe", {"fp32": 14.0, "fp16": 112.0}),
    # NVIDIA T4 datasheet: FP32 8.1, Mixed Precision (FP16/FP32) 65.
    (r"\bt4\b", "T4", {"fp32": 8.1, "fp16": 65.0}),
]

# The matrix units' input type of each precision option (32-true: tf32 where its matmuls use TF32).
_PRECISION_KIND = {"32-true": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16"}


def peak_tflops(device_name: str, kind: str) -> Optional[tuple[str, float]]:
    """(the table's name for the GPU, its dense peak TFLOP/s for `kind`), or None when the table does not know it."""
    name = device_name.lower()
    for pattern, label, peaks in PEAK_TFLOPS:
        if re.search(pattern, name):
            return (label, peaks[kind]) if kind in peaks else None
    return None


def tf32_matmuls() -> bool:
    """Whether float32 matmuls on CUDA run on TF32 tensor cores now."""
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # torch >= 2.9 with per-backend settings: this query refuses, the backend's answers
        return torch.backends.cuda.matmul.fp32_precision == "tf32"


def precision_kind(precision: str, device: torch.device) -> Optional[str]:
    kind = _PRECISION_KIND.get(precision)
    if kind == "fp32" and device.type == "cuda" and tf32_matmuls():
        return "tf32"
    return kind


def meta_twin(module: nn.Module, memo: Optional[dict] = None) -> nn.Module:
    """A copy of `module` whose parameters and buffers are empty meta tensors of the same global shapes.

    No weight is copied, no hook comes along (a strategy's all-gathers, DDP's reducer), and a class that a wrapper
    replaced (FSDP's `FSDP<Model>`) is back to the model's own; shared parameters stay shared.
    """
    memo = {} if memo is None else memo
    twin = object.__new__(_plain_class(type(module)))
    state = dict(vars(module))
    for key in [k for k in state if k.endswith(("_hooks", "_hooks_with_kwargs", "_always_called"))]:
        state[key] = type(state[key])() if isinstance(state[key], dict) else state[key]
    state.pop("_compiled_call_impl", None)
    state["_parameters"] = {k: _meta(p, memo) for k, p in module._parameters.items()}
    state["_buffers"] = {k: _meta(b, memo) for k, b in module._buffers.items()}
    state["_modules"] = {k: (meta_twin(m, memo) if m is not None else None) for k, m in module._modules.items()}
    vars(twin).update(state)
    return twin


def _plain_class(cls: type) -> type:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no module is FSDP's (its import costs seconds)
    FSDPModule = getattr(fsdp, "FSDPModule", None)
    if FSDPModule is None:
        return cls
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule)) if issubclass(cls, FSDPModule) else cls


def _meta(tensor: Optional[torch.Tensor], memo: dict) -> Optional[torch.Tensor]:
    if tensor is None:
        return None
    if id(tensor) not in memo:
        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")  # a DTensor's shape is the global one
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return memo[id(tensor)]


def count_flops(task_module: nn.Module, batch: Any, on_meta: bool = True) -> int:
    """FLOPs of the forward and backward pass of `task_module` (a TaskModule) on `batch`, counted on the meta device
    (`on_meta=False`: on the module and batch as they are, for a model built for the trial on the CPU).

    Nothing runs on the real device and no random number generator moves, so training is unchanged. Matrix
    products and attention are counted (torch's FlopCounterMode); elementwise work is not, as in MFU's convention.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from runner.precision import Precision
    from runner.tasks import TaskModule

    # A copy of the task: its first-batch checks must still run on the first real batch.
    model = meta_twin(task_module.model) if on_meta else task_module.model
    twin = TaskModule(model, copy.copy(task_module.task), Precision())
    meta_batch = apply_to_tensors(batch, lambda t: t.to("meta")) if on_meta else batch
    with torch.random.fork_rng(devices=[]), FlopCounterMode(display=False) as counter:
        twin(meta_batch)["loss"].sum().backward()
    return counter.get_total_flops()


def _compiled(module: nn.Module) -> bool:
    """Whether the module, or a part of it (one a LightningModule compiles in its setup), runs compiled code."""
    return any(getattr(m, "_compiled_call_impl", None) is not None or type(m).__name__ == "OptimizedModule"
               for m in module.modules())


class StepFlops:
    """`throughput/tflops_per_s` (the whole job's model FLOP rate) and, where the GPUs' peak is known,
    `throughput/mfu`, for the loop's log steps.

    The FLOPs are counted once, at the first step: on the meta device from its first micro-batch's shapes, or, for a
    model the meta device cannot run (HuggingFace's read tensors' values with .item()), on the first step's own
    tensors while it trains (the step is the same step; it only runs under torch's FLOP counter). Each log step then
    multiplies the FLOPs per sample by the samples it reduced anyway, so no later step pays anything for them.
    """

    def __init__(self, strategy: Any, task_module: nn.Module, wrapped: nn.Module, batch_size: int,
                 peak_tflops: Optional[float] = None) -> None:
        self.strategy, self.task_module, self.batch_size = strategy, task_module, batch_size
        self.configured_peak = peak_tflops
        # GPUs in the job: one per process, or the DataParallel replicas of the one process.
        self.devices = strategy.world_size * len(getattr(wrapped, "device_ids", None) or [None])
        self.pending = True
        self.per_sample: Optional[float] = None
        self.peak: Optional[float] = None  # the whole job's peak TFLOP/s

    def count(self, window: list, step: Callable[[], None]) -> float:
        """Take the first `step` (which trains on `window`), counting its FLOPs; returns the seconds the count on
        the meta device took (no step's time)."""
        start, self.pending = time.perf_counter(), False
        try:
            flops = count_flops(self.task_module, window[0])
        except Exception as error:  # noqa: BLE001 - a model the meta device cannot run: counted on the step itself
            seconds = time.perf_counter() - start
            self._count_on_the_step(step, len(window), f"{type(error).__name__}: {' '.join(str(error).split())[:200]}")
            return seconds
        seconds = time.perf_counter() - start
        step()
        self._per_sample(flops, self.batch_size, "counted once")
        return seconds

    def _count_on_the_step(self, step: Callable[[], None], micro_batches: int, why: str) -> None:
        if _compiled(self.task_module):  # the counter's module hooks would trip, or recompile, compiled code
            log.info("throughput/tflops_per_s is not logged: the model's FLOPs could not be counted on the meta "
                     "device (%s), nor on a compiled step's tensors", why)
            step()
            return
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            step()
        self._per_sample(counter.get_total_flops(), self.batch_size * micro_batches,
                         f"counted on the first step's own tensors, as the meta device cannot run the model: {why}")

    def _per_sample(self, flops: int, samples: int, where: str) -> None:
        if flops > 0:
            self.per_sample = flops / samples
            self.peak = self._job_peak(where)

    def _job_peak(self, where: str) -> Optional[float]:
        device = self.strategy.root_device
        precision = getattr(self.strategy.precision, "precision", "32-true")
        kind = precision_kind(precision, device)
        per_device, source = self.configured_peak, "trainer.peak_tflops"
        if per_device is None and device.type == "cuda" and kind is not None:
            found = peak_tflops(torch.cuda.get_device_name(device), kind)
            per_device, source = (found[1], f"{found[0]} {kind} datasheet") if found else (None, "")
        log.info("model FLOPs: %.4g GFLOP per sample (forward and backward, %s), matmuls in %s; %s",
                 self.per_sample / 1e9, where, kind or precision,
                 f"throughput/mfu against {per_device:g} TFLOP/s per device "
                 f"({source})" if per_device else "no peak known for this device and precision: "
                 "trainer.peak_tflops=<TFLOP/s> adds throughput/mfu")
        return per_device * self.devices if per_device else None

    def metrics(self, samples: float, seconds: float) -> dict[str, float]:
        """The log step's rates over `samples` (every process's) trained in `seconds`."""
        if self.per_sample is None:
            return {}
        tflops = self.per_sample * samples / seconds / 1e12
        return {"throughput/tflops_per_s": tflops, **({"throughput/mfu": tflops / self.peak} if self.peak else {})}
