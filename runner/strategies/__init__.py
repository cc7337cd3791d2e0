"""Strategies: how a model is placed on devices and how processes talk to each other."""

from runner.strategies.ddp import DDPStrategy
from runner.strategies.dp import DataParallelStrategy
from runner.strategies.single import SingleDeviceStrategy
from runner.strategies.strategy import Strategy

__all__ = ["Strategy", "SingleDeviceStrategy", "DataParallelStrategy", "DDPStrategy"]


def auto_strategy(
    accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None, precision=None,
    start_method: str = "popen",
) -> Strategy:
    """`strategy=auto`: one device in one process trains with the single-device strategy, anything more with DDP."""
    environment = cluster_environment
    external = environment is not None and environment.creates_processes_externally
    if len(parallel_devices or [None]) == 1 and not (external and environment.world_size() > 1):
        return SingleDeviceStrategy(parallel_devices[0], accelerator, checkpoint_io, precision)
    return DDPStrategy(
        accelerator, parallel_devices, environment, checkpoint_io, precision, start_method=start_method
    )
