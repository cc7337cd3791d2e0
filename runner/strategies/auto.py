"""`strategy=auto`: the single-device strategy for one device in one process, DDP for anything more."""

from typing import Optional

import torch

from runner.accelerators import Accelerator
from runner.checkpoint_io import CheckpointIO
from runner.environments import ClusterEnvironment, LocalEnvironment
from runner.precision import Precision
from runner.strategies.ddp import DDPStrategy
from runner.strategies.single import SingleDeviceStrategy
from runner.strategies.strategy import Strategy


def auto_strategy(
    accelerator: Optional[Accelerator] = None,
    parallel_devices: Optional[list[torch.device]] = None,
    cluster_environment: Optional[ClusterEnvironment] = None,
    checkpoint_io: Optional[CheckpointIO] = None,
    precision: Optional[Precision] = None,
    start_method: str = "forkserver",
) -> Strategy:
    """`strategy=auto`: one device in one process trains with the single-device strategy, anything more with DDP."""
    devices = parallel_devices or [torch.device("cpu")]
    environment = cluster_environment or LocalEnvironment()
    started_elsewhere = environment.creates_processes_externally and environment.world_size() > 1
    if len(devices) == 1 and not started_elsewhere:
        return SingleDeviceStrategy(devices[0], accelerator, checkpoint_io, precision)
    return DDPStrategy(accelerator, devices, environment, checkpoint_io, precision, start_method=start_method)
