"""Multi-process data parallel training: one process per device, gradients averaged by DistributedDataParallel."""

from __future__ import annotations

import datetime
import math
import os
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from runner.accelerators import Accelerator
from runner.checkpoint_io import CheckpointIO
from runner.environments import ClusterEnvironment, LocalEnvironment
from runner.precision import Precision
from runner.strategies import sync_batchnorm
from runner.strategies.strategy import Strategy, T, WorkerProcesses

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
_MEAN_NAMES = ("mean", "avg")
# The launcher's stall watch ends a job before its collectives' timeout would: at this share of it, if not sooner,
# unless that leaves less than the floor (a timeout that short is the user's own stall watch).
STALL_SHARE, STALL_FLOOR_S = 0.8, 10.0


class DDPStrategy(Strategy):
    """`start_method` says how the launcher creates local processes; extra keyword arguments go to DDP.

    `sync_batchnorm`: the model's batch-norm layers compute their statistics over the global batch (all processes'
    shares together), so N processes x batch B train as 1 process x N*B does; without it, over each process's share.
    """

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
        stall_timeout: Optional[float] = 300,
        sync_batchnorm: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"strategy.start_method={start_method!r} is not one of popen, spawn, fork, forkserver")
        problems = list(filter(None, [timeout_problem(timeout), stall_timeout_problem(stall_timeout)]))
        if problems:
            from runner.config import ConfigError

            raise ConfigError(problems)
        # A plain list: Hydra hands a ListConfig, whose item look-up (root_device, each step) costs 15 µs, not 1.
        self.parallel_devices = list(parallel_devices or [torch.device("cpu")])
        self.cluster_environment = cluster_environment or LocalEnvironment()
        self.process_group_backend = process_group_backend
        self.timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        self.start_method = start_method
        # Seconds a launched rank may go without progress before the launcher ends the job naming it.
        self.stall_timeout = stall_timeout or None
        self.sync_batchnorm = sync_batchnorm
        self._host_group: Any = None  # a gloo group for host-side votes (the process group itself under gloo)
        self._ddp_kwargs = kwargs

    # -- who am I -------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank % len(self.parallel_devices)]

    @property
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank()

    @property
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank()

    @property
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank()

    @property
    def world_size(self) -> int:
        return self.cluster_environment.world_size()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def processes(self) -> Optional[WorkerProcesses]:
        if self.cluster_environment.creates_processes_externally or len(self.parallel_devices) == 1:
            return None
        limit, setting = self._stall_limit()
        return WorkerProcesses(len(self.parallel_devices), self.start_method, limit, setting)

    def _stall_limit(self) -> tuple[Optional[float], str]:
        """`stall_timeout`, kept below `timeout` where that leaves STALL_FLOOR_S seconds or more: the launcher
        names the stuck rank before a collective gives up and blames a rank that waited for it."""
        if not self.stall_timeout:
            return None, ""
        below = STALL_SHARE * self.timeout.total_seconds()
        if self.stall_timeout <= below or below < STALL_FLOOR_S:
            return self.stall_timeout, f"strategy.stall_timeout={self.stall_timeout:g}"
        return below, (f"strategy.stall_timeout={self.stall_timeout:g}, kept below strategy.timeout="
                       f"{self.timeout.total_seconds():g}")

    def _backend(self) -> str:
        if self.process_group_backend:
            return self.process_group_backend
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    # -- set-up ---------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Join the process group (once per process, before any communication)."""
        super().setup_environment()
        if dist.is_initialized():
            return
        env = self.cluster_environment
        if self.world_size == 1 and env.main_port == 0:
            # A one-process group needs no rendezvous, hence no port that could collide.
            store = dist.HashStore()
        else:
            store = self._tcp_store(env.main_address, env.main_port)
        dist.init_process_group(
            self._backend(), store=store, rank=self.global_rank, world_size=self.world_size, timeout=self.timeout
        )

    def _tcp_store(self, address: str, port: int) -> dist.Store:
        # Under torchelastic the launcher's agent already serves the store; elsewhere rank 0 hosts it.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        is_master = self.global_rank == 0 and not agent_store
        if is_master and _is_loopback(address):
            # A TCPStore server listens on every interface whatever its address: for a job whose ranks meet on
            # loopback, rank 0 binds the socket to it and the store serves there alone.
            store = _loopback_store(address, port, self.world_size, self.timeout)
        else:
            store = dist.TCPStore(address, port, self.world_size, is_master=is_master, timeout=self.timeout)
        # Workers restarted by torchelastic reuse the agent's store: a fresh prefix per attempt keeps them
        # from reading the addresses the failed attempt's processes left there.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"runner/attempt_{attempt}", store)

    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        module = self._batchnorm(module)
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        try:
            return DistributedDataParallel(module, device_ids=device_ids, **self._ddp_kwargs)
        except TypeError as error:  # a value of the wrong type for an argument typed only in C++
            from runner.config import ConfigError

            settings = ", ".join(f"strategy.{k}={v!r}" for k, v in self._ddp_kwargs.items())
            message = " ".join(str(error).split("Invoked with")[0].split())
            raise ConfigError([f"DistributedDataParallel does not accept {settings}: {message}"]) from None

    def _batchnorm(self, module: nn.Module) -> nn.Module:
        """Before wrapping: batch norm over the global batch under `sync_batchnorm`; else, with several processes,
        one warning (rank 0) that its statistics are each process's own."""
        if self.sync_batchnorm:
            return sync_batchnorm.convert(module, self.root_device, self.world_size, report=self.is_global_zero)
        if self.is_global_zero:
            sync_batchnorm.warn_per_process(module, self.world_size)
        return module

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def backward_sync(self, module: nn.Module, enabled: bool) -> ContextManager:
        if enabled or not isinstance(module, DistributedDataParallel):
            return nullcontext()
        return module.no_sync()

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce `tensor` over all processes. 'mean' divides a sum; integer tensors come back as floats."""
        return self.start_all_reduce(tensor, group, reduce_op)()

    def start_all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Callable[[], Any]:
        """`all_reduce` without waiting: the reduction runs on the process group's thread while this one goes on.

        Calling the result waits for it and returns the reduced copy; `tensor` itself is free to change.
        """
        if not isinstance(tensor, torch.Tensor):
            return lambda: tensor
        mean = isinstance(reduce_op, str) and reduce_op.lower() in _MEAN_NAMES
        op = _resolve_op(reduce_op)
        if mean and not (tensor.is_floating_point() or tensor.is_complex()):
            # gloo has no average and integer division would truncate: reduce as float instead.
            tensor = tensor.double()
        else:
            tensor = tensor.clone()
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)

        def wait() -> torch.Tensor:
            work.wait()
            return tensor / dist.get_world_size(group) if mean else tensor
        return wait

    def reduce(self, collection: Any, *args: Any, **kwargs: Any) -> Any:
        return self.all_reduce(collection, *args, **kwargs)

    def barrier(self, name: Optional[str] = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """True when every process (all=True) or any process (all=False) decided True."""
        votes = self.all_reduce(torch.tensor(int(bool(decision)), device=self.root_device), reduce_op="sum")
        return bool(votes == self.world_size) if all else bool(votes > 0)

    def start_any_signal(self, signum: Any) -> Callable[[], Any]:
        # On the host, through gloo: reading a device tensor each step would wait for the step's kernels.
        if self._host_group is None:
            self._host_group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        vote = torch.tensor(signum, dtype=torch.int32)
        work = dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._host_group, async_op=True)

        def wait() -> Any:
            work.wait()
            return vote.tolist() if vote.dim() else int(vote)
        return wait

    def teardown(self) -> None:
        super().teardown()
        self._host_group = None
        if dist.is_initialized():
            dist.destroy_process_group()


def timeout_problem(timeout: Any) -> Optional[str]:
    """What is wrong with `strategy.timeout` (seconds any collective may wait), or None."""
    if isinstance(timeout, datetime.timedelta) or (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                                   and 0 < timeout < math.inf):
        return None
    return f"strategy.timeout={timeout} must be a positive number of seconds (a finite one: 1800 is half an hour)"


def stall_timeout_problem(stall_timeout: Any) -> Optional[str]:
    """What is wrong with `strategy.stall_timeout` (seconds a rank may make no progress), or None."""
    if stall_timeout is None or (isinstance(stall_timeout, (int, float)) and stall_timeout >= 0):
        return None
    return f"strategy.stall_timeout={stall_timeout} must be a number of seconds (0 or null: no watch)"


def _is_loopback(address: str) -> bool:
    import ipaddress

    try:
        return address == "localhost" or ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name
        return False


def _loopback_store(address: str, port: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    import socket

    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1" if address == "localhost" else address, port))
        listener.listen(128)
        # The store's server takes the socket over: detached, Python no longer closes it.
        return dist.TCPStore(address, listener.getsockname()[1], world_size, is_master=True, timeout=timeout,
                             master_listen_fd=listener.detach(), use_libuv=True)
    finally:
        listener.close()


def _resolve_op(reduce_op: Any) -> Any:
    if reduce_op is None:
        return dist.ReduceOp.SUM
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        if name in _MEAN_NAMES:
            return dist.ReduceOp.SUM
        if name not in _REDUCE_OPS:
            raise ValueError(f"reduce_op={reduce_op!r} is not one of {', '.join((*_MEAN_NAMES, *_REDUCE_OPS))}")
        return _REDUCE_OPS[name]
    return reduce_op
