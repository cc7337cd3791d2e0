"""The strategy interface the training loop calls, with the single-process behaviour as its default."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, TypeVar

import torch
from torch import nn

from runner.accelerators import Accelerator, CPUAccelerator
from runner.checkpoint_io import CheckpointIO, TorchCheckpointIO
from runner.precision import Precision
from runner.tree import apply_to_tensors

T = TypeVar("T")


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a (nested) batch to `device`, keeping the container types."""
    non_blocking = device.type == "cuda"
    return apply_to_tensors(batch, lambda tensor: tensor.to(device, non_blocking=non_blocking))


@dataclass(frozen=True)
class WorkerProcesses:
    """The processes a strategy needs started on this node; the job picks the launcher that starts them."""

    count: int
    start_method: str = "popen"  # popen, spawn, fork or forkserver
    stall_timeout: Optional[float] = None  # seconds a worker may go without progress; None: not watched
    stall_setting: str = ""  # the setting that chose stall_timeout, as the stall message names it


class Strategy:
    """One process, one device. Subclasses override what changes with more devices or processes."""

    # Whether each forward is a collective (FSDP all-gathers): evaluations then run as many forwards on every process.
    collective_forward = False

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
    ) -> None:
        self.accelerator = accelerator or CPUAccelerator()
        self.checkpoint_io = checkpoint_io or TorchCheckpointIO()
        self.precision = precision or Precision()

    # -- who am I -------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        raise NotImplementedError

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> Optional[dict[str, Any]]:
        return None

    @property
    def processes(self) -> Optional[WorkerProcesses]:
        """The processes to start for this strategy; None when this process is the only one, or they exist
        already (torchrun, srun)."""
        return None

    # -- set-up ---------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        self.accelerator.setup_device(self.root_device)
        self.precision.setup(self.root_device)

    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    def setup_module(self, module: nn.Module) -> nn.Module:
        return module

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None) -> Any:
        return move_to_device(batch, device or self.root_device)

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The module as the user built it, whatever wrapper `setup_module` put around it."""
        return module

    # -- steps ----------------------------------------------------------------------------------
    def training_step(self, module: nn.Module, *args: Any) -> Any:
        return module(*args)

    def validation_step(self, module: nn.Module, *args: Any) -> Any:
        return self.unwrap(module)(*args)

    def backward_sync(self, module: nn.Module, enabled: bool) -> ContextManager:
        """Context for a backward pass; `enabled=False` skips gradient sync (accumulation micro-steps)."""
        return nullcontext()

    # -- collectives (identity for one process) -------------------------------------------------
    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def start_all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Callable[[], Any]:
        """Start `all_reduce` of a copy of `tensor` and return at once; calling the result waits and returns it.

        Every process must start the same reductions in the same order, as with `all_reduce`.
        """
        result = self.all_reduce(tensor.clone() if isinstance(tensor, torch.Tensor) else tensor, group, reduce_op)
        return lambda: result

    def reduce(self, collection: Any, *args: Any, **kwargs: Any) -> Any:
        return collection

    def barrier(self, name: Optional[str] = None) -> None:
        return None

    def broadcast(self, obj: T, src: int = 0) -> T:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def start_any_signal(self, signum: Any) -> Callable[[], Any]:
        """Start agreeing on a stop signal; calling the result waits and returns the highest `signum` of all
        processes (0: none got one). A list of integers is reduced item by item, each to its highest."""
        return lambda: signum

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict, path: Any) -> None:
        """Rank 0 writes through the checkpoint IO; every rank waits until it is written."""
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, path)
        self.barrier("save_checkpoint")

    def remove_checkpoint(self, path: Any) -> None:
        """Rank 0 removes the file through the checkpoint IO (after its pending writes), or the sharded folder an
        earlier strategy=fsdp run left at that name."""
        from runner.checkpoint_io import sharded

        if self.is_global_zero:
            self.checkpoint_io.wait()
            if sharded.is_sharded(path):
                sharded.remove(path)
            else:
                self.checkpoint_io.remove_checkpoint(path)

    def load_checkpoint(self, path: Any, trust_unchecked: bool = False) -> dict:
        """A checkpoint file, or a sharded folder (strategy=fsdp's) read whole; either verified against the
        checksums written with it (one without them only with `trust_unchecked`)."""
        from runner.checkpoint_io import sharded, trust

        if sharded.is_sharded(path):
            return sharded.read(path, trust_unchecked=trust_unchecked)
        return trust.load_file(self.checkpoint_io, path, trust_unchecked)

    def teardown(self) -> None:
        self.checkpoint_io.teardown()
        self.precision.teardown()
        self.accelerator.teardown()
