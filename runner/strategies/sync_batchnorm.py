"""Batch norm over the global batch (`strategy.sync_batchnorm=true`), and the warning when it is per process."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

log = logging.getLogger("runner")


class SyncBatchNorm(_BatchNorm):
    """A batch-norm layer whose training statistics are those of every process's input together, on any device.

    torch.nn.SyncBatchNorm refuses CPU tensors (and DistributedDataParallel refuses it on CPU); this layer reduces
    with the process group's own collectives instead, through autograd, so the gradients are those of one process
    holding the whole batch. Its parameters, buffers, state_dict keys and running-statistics update are
    BatchNorm's; in eval mode, and with one process, it is BatchNorm.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, device: Any = None, dtype: Any = None,
                 *, bias: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype,
                         bias=bias)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and _world_size(self.process_group) > 1):
            return super().forward(input)
        self._check_input_dim(input)
        if input.size(1) != self.num_features:
            raise ValueError(f"{type(self).__name__}({self.num_features}) got input of {input.size(1)} channels "
                             f"(shape {tuple(input.shape)})")
        mean, var, count = _global_moments(input, self.process_group)
        if count <= 1:  # what BatchNorm says for a batch of one
            raise ValueError(f"Expected more than 1 value per channel when training, got {count:g} over "
                             f"{_world_size(self.process_group)} processes (input size {tuple(input.shape)} here)")
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), count)
        return _normalize(input, mean, var, self.weight, self.bias, self.eps)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        """BatchNorm's rule: momentum (None: the cumulative average), the unbiased variance into running_var."""
        assert self.num_batches_tracked is not None and self.running_mean is not None and self.running_var is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype) * factor)
        unbiased = var * (count / (count - 1))
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype) * factor)

    @classmethod
    def convert(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """torch.nn.SyncBatchNorm.convert_sync_batchnorm with this class: every batch-norm layer of `module`
        replaced by one sharing its parameters and buffers (`module` itself when it is one)."""
        converted = module
        if isinstance(module, _BatchNorm):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, bias=module.bias is not None)
            converted.weight, converted.bias = module.weight, module.bias
            converted.running_mean, converted.running_var = module.running_mean, module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert(child, process_group))
        return converted


def _world_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _channel_shape(input: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (input.dim() - 2)


class _SumOverProcesses(torch.autograd.Function):
    """`tensor` summed over the processes of `group`; its backward sums every process's gradient of the sum (each
    process's loss reads it), so each process's input gets the gradient of all their losses."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _global_moments(input: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per channel, the mean and the biased variance of all processes' `input` together, and how many values each
    channel has. Two passes, as one process computes them (no cancellation of E[x^2] - E[x]^2); sums and the count
    travel in float64. The collectives' backward sums every process's gradient of the statistics."""
    x = input if input.dtype in (torch.float32, torch.float64) else input.float()
    dims = [0, *range(2, x.dim())]
    count = torch.tensor([x.numel() // max(x.size(1), 1)], dtype=torch.float64, device=x.device)
    sums = _SumOverProcesses.apply(torch.cat([x.sum(dims).double(), count]), group)
    total = float(sums[-1].detach())  # a count: no gradient flows through it
    mean = (sums[:-1] / total).to(x.dtype)
    squares = ((x - mean.view(_channel_shape(x))) ** 2).sum(dims).double()
    var = (_SumOverProcesses.apply(squares, group) / total).to(x.dtype)
    return mean, var, total


def _normalize(input: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, weight: Optional[torch.Tensor],
               bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    shape = _channel_shape(input)
    out = (input.to(mean.dtype) - mean.view(shape)) * torch.rsqrt(var + eps).view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    return out.to(input.dtype)


# -- what the strategies call -----------------------------------------------------------------------

# Devices whose tensors torch.nn.SyncBatchNorm takes (it raises for the CPU's); any other gets this module's layer.
_TORCH_SYNC_DEVICES = ("cuda", "hpu", "xpu")


def batchnorm_layers(module: nn.Module) -> list[nn.Module]:
    """The batch-norm layers of `module` (any _BatchNorm: BatchNorm1d/2d/3d, SyncBatchNorm, those inside HF models)."""
    return [m for m in module.modules() if isinstance(m, _BatchNorm)]


def _described(layers: list[nn.Module]) -> str:
    counts = Counter(type(layer).__name__ for layer in layers)
    return ", ".join(f"{name} x{count}" if count > 1 else name for name, count in counts.items())


def convert(module: nn.Module, device: torch.device, world_size: int, report: bool) -> nn.Module:
    """`module` with batch norm over all processes' batches (torch's SyncBatchNorm where it runs, the CPU's here);
    `report`: say in one line what was converted."""
    layers = batchnorm_layers(module)
    if device.type in _TORCH_SYNC_DEVICES:
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    else:
        module = SyncBatchNorm.convert(module)
    if report:
        if layers:
            log.info("strategy.sync_batchnorm=true: %d batch-norm layer(s) (%s) compute their statistics over the "
                     "global batch of %d process(es)", len(layers), _described(layers), world_size)
        else:
            log.info("strategy.sync_batchnorm=true: the model has no batch-norm layers; nothing to synchronise")
    return module


def warn_per_process(module: nn.Module, world_size: int) -> None:
    """One line when several processes each compute the statistics of their own share of the batch."""
    layers = batchnorm_layers(module)
    if layers and world_size > 1:
        log.warning("the model's %d batch-norm layer(s) (%s) compute their statistics per process, over each "
                    "process's share of the batch: results depend on the number of processes (%d); "
                    "strategy.sync_batchnorm=true computes them over the global batch", len(layers),
                    _described(layers), world_size)


def warn_per_device(module: nn.Module, devices: int) -> None:
    """strategy=dp's line: its replicas each compute the statistics of their device's share of the batch."""
    layers = batchnorm_layers(module)
    if layers and devices > 1:
        log.warning("the model's %d batch-norm layer(s) (%s) compute their statistics per device under strategy=dp, "
                    "over each device's share of the batch: results depend on the number of devices (%d); dp cannot "
                    "synchronise them: use strategy=ddp strategy.sync_batchnorm=true", len(layers),
                    _described(layers), devices)
