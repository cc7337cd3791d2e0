"""Fully sharded data parallel training (FSDP2): each process holds 1/N of the parameters, gradients and
optimizer state, gathers a block's parameters just before it runs, and checkpoints its own shards."""

from __future__ import annotations

import copy
import datetime
import logging
import secrets
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, ContextManager, Iterator, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from runner.accelerators import Accelerator
from runner.checkpoint_io import AsyncCheckpointIO, CheckpointError, CheckpointIO
from runner.checkpoint_io import optimizer_keys, sharded
from runner.environments import ClusterEnvironment
from runner.precision import Precision
from runner.strategies.ddp import DDPStrategy, StartMethod
from runner.tree import apply_to_tensors

log = logging.getLogger("runner")
StateDictType = Literal["sharded", "full"]
STATE_DICT_TYPES = ("sharded", "full")


class FSDPStrategy(DDPStrategy):
    """DDP's processes, process group and collectives; the model sharded with `fully_shard`.

    `shard`: class names of the submodules that become their own FSDP unit (gathered and freed together), or
    `auto`: every block of the model's first `nn.Sequential`/`nn.ModuleList` holding two or more blocks with
    parameters. The model itself is always the root unit. `activation_checkpointing`: class names of the
    submodules whose activations are recomputed in the backward pass instead of kept. `sync_batchnorm`: as DDP's.
    `state_dict_type=sharded` saves a folder of every process's shards; `full` one file, as DDP does.
    """

    collective_forward = True  # every forward all-gathers: evaluations run as many forwards on every process

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[datetime.timedelta, float, int] = datetime.timedelta(seconds=1800),
        start_method: StartMethod = "forkserver",
        shard: Union[str, list[str]] = "auto",
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing: Optional[list[str]] = None,
        state_dict_type: StateDictType = "sharded",
        stall_timeout: Optional[float] = 300,
        sync_batchnorm: bool = False,
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision,
                         process_group_backend, timeout, start_method, stall_timeout, sync_batchnorm)
        shard = as_names(shard) if shard != "auto" else shard
        activation_checkpointing = as_names(activation_checkpointing) if activation_checkpointing else []
        problems = settings_problems(shard, activation_checkpointing, state_dict_type, self.precision)
        if problems:
            from runner.config import ConfigError

            raise ConfigError(problems)
        self.shard = shard
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.activation_checkpointing = list(activation_checkpointing or [])
        self.state_dict_type = state_dict_type
        self._model: Optional[nn.Module] = None  # the user's model, sharded: what checkpoints hold
        self._async = state_dict_type == "sharded" and isinstance(self.checkpoint_io, AsyncCheckpointIO)
        self._checkpoint_group: Any = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None
        self._error: Optional[tuple[str, Exception]] = None
        self._lock = threading.Lock()

    # -- set-up ---------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        if self._async and self._checkpoint_group is None:
            # Background saves talk over a group of their own: collectives of two threads on one group could
            # interleave differently on different ranks.
            self._checkpoint_group = dist.new_group(backend="gloo")

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard the user's model in place (the module keeps its class, keys and `model` attribute)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        # Strategies wrap the TaskModule; its `model` is the user's module, whose state checkpoints hold. The
        # model is the root unit, so calling it (training, validation, predict) gathers its parameters.
        module = self._batchnorm(module)  # before sharding: the converted layers' parameters are sharded
        model = getattr(module, "model", module)
        wrapped = apply_activation_checkpointing(model, self.activation_checkpointing)
        units = shard_units(model, self.shard)
        names, root = Counter(class_name(unit) for unit in units), type(model).__name__  # before fully_shard renames
        mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward}
        if getattr(self.precision, "precision", None) == "bf16-mixed":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        options["offload_policy"] = (CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
                                     if self.cpu_offload else OffloadPolicy())
        for unit in reversed(units):  # innermost first, as FSDP expects nested units
            fully_shard(unit, **options)
        fully_shard(model, **options)
        log.info("strategy=fsdp: %d unit(s) over %d process(es): %s, then the root %s; activation checkpointing: %s",
                 len(units) + 1, self.world_size, ", ".join(f"{n} x{c}" for n, c in names.items()) or "none",
                 root, f"{wrapped} module(s)" if wrapped else "off")
        self._model = model
        return module

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module  # fully_shard works in place

    def backward_sync(self, module: nn.Module, enabled: bool) -> ContextManager:
        """`enabled=False` (accumulation micro-steps): no reduce-scatter; FSDP keeps the unsharded sums."""
        from torch.distributed.fsdp import FSDPModule

        root = self._model if isinstance(self._model, FSDPModule) else None
        return nullcontext() if enabled or root is None else _gradient_sync_off(root)

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict, path: Any) -> None:
        """Every rank calls it. sharded: all ranks write their shards to a temporary folder, rank 0 renames it
        into place; full: the shards are gathered and rank 0 writes one file through the checkpoint IO."""
        if self.state_dict_type == "full":
            super().save_checkpoint(apply_to_tensors(checkpoint, _full_tensor), path)
            return
        self._raise_failed()
        path = Path(path)
        token = self.broadcast(secrets.token_hex(4))
        tmp = sharded.temporary_path(path, token)
        tensors, rest = sharded.split(checkpoint, self._parameter_names())
        rest = rest if self.is_global_zero else None
        if not self._async:
            self._write(tensors, rest, tmp, path, None)
            self._raise_failed()
            self.barrier("save_checkpoint")
            return
        # The next optimizer step changes the tensors in place: copy them before returning.
        snapshot = apply_to_tensors(tensors, lambda t: t.detach().clone())
        if self._executor is None:  # one thread: saves run in the same order on every rank
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp-checkpoint")
        self._pending = self._executor.submit(self._write, snapshot, copy.deepcopy(rest), tmp, path,
                                              self._checkpoint_group)

    def _write(self, tensors: dict, rest: Optional[dict], tmp: Path, path: Path, group: Any) -> None:
        try:
            sharded.write(tensors, rest, tmp, group)
            if rest is not None:
                sharded.publish(tmp, path)
        except Exception as err:  # kept for the caller's thread (a background one has no caller)
            with self._lock:
                self._error = self._error or (str(path), err)

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        self._raise_failed()

    def _raise_failed(self) -> None:
        with self._lock:
            failed, self._error = self._error, None
        if failed is not None:
            path, err = failed
            reason = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
            raise CheckpointError(f"cannot write sharded checkpoint {path}: {reason}; the previous checkpoint "
                                  "there is left intact") from err

    def remove_checkpoint(self, path: Any) -> None:
        if self.is_global_zero:
            self._wait()
            if sharded.is_sharded(path):
                sharded.remove(path)
            else:
                self.checkpoint_io.remove_checkpoint(path)

    def load_checkpoint(self, path: Any, trust_unchecked: bool = False) -> dict:
        """Any checkpoint of the runner, resharded for this run's processes (every rank calls it), verified
        against its checksums first (one without them only with `trust_unchecked`).

        A sharded folder is read part by part: each process reads only the slices of its own shards. A full
        file (of strategy=single, ddp or fsdp with state_dict_type=full) is read whole and each process keeps
        its slices.
        """
        from runner.checkpoint_io import trust

        self._wait()
        self.barrier("load_checkpoint")  # what rank 0 published is there for every rank
        if self._model is None:
            return super().load_checkpoint(path, trust_unchecked)
        if sharded.is_sharded(path):
            targets: dict = {}

            def allocate(where: tuple, size: torch.Size, dtype: torch.dtype, rest: dict) -> torch.Tensor:
                if not targets:  # state.pt is read once its checksum has been verified
                    targets.update(self._targets(rest["optimizer"]))
                return _allocate(_target(where, targets), size, dtype)

            return sharded.read(path, allocate, trust_unchecked=trust_unchecked)
        return self._shard_checkpoint(path, trust.load_file(self.checkpoint_io, path, trust_unchecked))

    def _parameter_names(self) -> list[str]:
        assert self._model is not None
        return [optimizer_keys.clean(name) for name, _ in self._model.named_parameters()]

    def _targets(self, optimizer_state: dict) -> dict:
        """This run's sharded model state by key, and (folders written before names) its parameters by the
        checkpoint's optimizer index, which was then the model's order."""
        assert self._model is not None
        states = optimizer_keys.states_of(optimizer_state)
        indices = [index for state in states for group in state.get("param_groups", []) for index in group["params"]]
        return {"model": self._model.state_dict(), "indexed": dict(zip(indices, self._model.parameters()))}

    def _shard_checkpoint(self, path: Any, checkpoint: dict) -> dict:
        """A full checkpoint's model and optimizer tensors cut to this process's shards (no communication)."""
        model_state = self._model.state_dict() if self._model is not None else {}
        checkpoint["model"] = {k: _slice_like(v, model_state.get(k)) for k, v in checkpoint["model"].items()}
        states = optimizer_keys.states_of(checkpoint["optimizer"])
        try:
            all_names = optimizer_keys.index_names(states, self._parameter_names())
        except CheckpointError as err:  # a file of several groups saved before optimizers recorded their names
            raise CheckpointError(f"cannot load checkpoint {path} under strategy=fsdp: {err}; resume it with "
                                  "strategy=ddp or single, whose optimizer takes its state by index") from None
        for state, names in zip(states, all_names):
            order = [index for group in state["param_groups"] for index in group["params"]]
            name_of = dict(zip(order, names))
            for index, entries in state.get("state", {}).items():
                target = model_state.get(name_of.get(int(index), ""))
                state["state"][index] = {k: _slice_like(v, target) for k, v in entries.items()}
        return checkpoint

    def teardown(self) -> None:
        try:
            self._wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            super().teardown()


def as_names(value: Any) -> Any:
    """A class name or a list of them (a ListConfig from Hydra too) as a list; anything else as it came."""
    if isinstance(value, str):
        return [value]
    try:
        return [str(v) if isinstance(v, str) else v for v in value]
    except TypeError:
        return value


@contextmanager
def _gradient_sync_off(root: Any) -> Iterator[None]:
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


def _target(where: tuple, targets: dict) -> Any:
    """This run's tensor that the checkpoint's tensor at `where` belongs to (None: a tensor of its own)."""
    if where[0] == "model":
        return targets["model"].get(where[1])
    if where[0] == "optimizers" and len(where) == 4:  # optimizers.<k>.<parameter name>.<name>
        return targets["model"].get(where[2])
    if where[0] == "optimizer_state":  # written before names: the model's order
        return targets["indexed"].get(int(where[1]))
    return None


def _allocate(target: Any, size: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Where DCP reads a checkpoint's tensor: this process's slice when `target` is sharded here alike."""
    if _is_dtensor(target) and tuple(target.shape) == tuple(size):
        return torch.empty_like(target, dtype=dtype)
    return torch.empty(size, dtype=dtype)


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor  # a collective: every rank in the same order


def _slice_like(value: Any, target: Any) -> Any:
    """`value` (a whole tensor every process holds) as a DTensor sharded like `target`, when shapes match."""
    from torch.distributed.tensor import distribute_tensor

    if not (isinstance(value, torch.Tensor) and _is_dtensor(target) and tuple(value.shape) == tuple(target.shape)):
        return value
    local = target.to_local()
    return distribute_tensor(value.to(device=local.device, dtype=value.dtype), target.device_mesh,
                             target.placements, src_data_rank=None)


# -- which modules: shared with the checks before start ----------------------------------------------

def class_name(module: nn.Module) -> str:
    """The class name the settings use; a module wrapped for activation checkpointing answers for what it wraps."""
    inner = getattr(module, "_checkpoint_wrapped_module", None)
    return type(inner if isinstance(inner, nn.Module) else module).__name__


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def auto_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks (children with parameters) of the first nn.Sequential/nn.ModuleList, breadth first, that has two
    or more of them; [] when the model has none (it is then one unit)."""
    queue = [model]
    while queue:
        module = queue.pop(0)
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            blocks = [child for child in module.children() if _has_parameters(child)]
            if len(blocks) >= 2:
                return blocks
        queue.extend(module.children())
    return []


def _candidates(model: nn.Module) -> list[nn.Module]:
    """The model's submodules in order, a checkpoint wrapper standing for the module it wraps."""
    inner = {id(m._checkpoint_wrapped_module) for m in model.modules() if hasattr(m, "_checkpoint_wrapped_module")}
    return [m for m in model.modules() if m is not model and id(m) not in inner]


def shard_units(model: nn.Module, shard: Union[str, list[str]]) -> list[nn.Module]:
    if isinstance(shard, str) and shard == "auto":
        return auto_blocks(model)
    names = [shard] if isinstance(shard, str) else list(shard)
    missing = sorted(set(names) - set(module_classes(model)))
    if missing:
        from runner.config import ConfigError

        raise ConfigError([unknown_classes_message("shard", missing, model)])
    return [m for m in _candidates(model) if class_name(m) in names and _has_parameters(m)]


def apply_activation_checkpointing(model: nn.Module, names: list[str]) -> int:
    """Wrap every submodule of a class in `names` to recompute its activations in backward; returns how many."""
    if not names:
        return 0
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    missing = sorted(set(names) - set(module_classes(model)))
    if missing:
        from runner.config import ConfigError

        raise ConfigError([unknown_classes_message("activation_checkpointing", missing, model)])
    count = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child).__name__ in names and not hasattr(parent, "_checkpoint_wrapped_module"):
                setattr(parent, child_name, checkpoint_wrapper(child))
                count += 1
    return count


def module_classes(model: nn.Module) -> list[str]:
    """The class names of the model's submodules (the model's own excluded), in order of first appearance."""
    return list(dict.fromkeys(class_name(m) for m in _candidates(model)))


def unknown_classes_message(key: str, missing: list[str], model: nn.Module) -> str:
    return (f"strategy.{key}={missing if len(missing) > 1 else missing[0]}: the model ({type(model).__name__}) has "
            f"no submodule of that class; it has {', '.join(module_classes(model)) or 'no submodules'}")


def settings_problems(shard: Any, activation_checkpointing: Any, state_dict_type: Any, precision: Any) -> list[str]:
    """What is wrong with FSDPStrategy's own settings, whatever the model."""
    problems = []
    if not (shard == "auto" or (isinstance(shard, list) and shard and all(isinstance(s, str) and s for s in shard))):
        problems.append(f"strategy.shard={shard!r} is not allowed: use auto, or a list of module class names "
                        "such as [Block]")
    if not (isinstance(activation_checkpointing, list) and all(isinstance(s, str) and s
                                                                for s in activation_checkpointing)):
        problems.append(f"strategy.activation_checkpointing={activation_checkpointing!r} is not allowed: use a list "
                        "of module class names such as [Block], or [] (off)")
    if state_dict_type not in STATE_DICT_TYPES:
        problems.append(f"strategy.state_dict_type={state_dict_type} is not allowed: use sharded or full")
    if getattr(precision, "precision", None) == "16-mixed":
        problems.append("precision=16-mixed is not supported by strategy=fsdp (float16 loss scaling over sharded "
                        "gradients); use precision=bf16-mixed")
    return problems
