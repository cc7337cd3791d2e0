"""Strategies: how a model is placed on devices and how processes talk to each other."""

from runner.strategies.auto import auto_strategy
from runner.strategies.ddp import DDPStrategy
from runner.strategies.dp import DataParallelStrategy
from runner.strategies.fsdp import FSDPStrategy
from runner.strategies.single import SingleDeviceStrategy
from runner.strategies.strategy import Strategy, WorkerProcesses

__all__ = ["Strategy", "SingleDeviceStrategy", "DataParallelStrategy", "DDPStrategy", "FSDPStrategy", "auto_strategy",
           "WorkerProcesses"]
