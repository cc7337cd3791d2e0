"""What a run will build, each piece worked out once from the composed config, for the checks and the job to read.

CLI → compose → [plan] → validate (the checks read the plan) → run folder → launch (from the plan's strategy) →
worker → build → loop → teardown. A piece is worked out by runner.build, as the workers will, at its first reading
and then kept: the checks that read it run after the ones that make building it safe (the config's keys, its plain
values, the signatures), so a config refused by those builds nothing here. A check reads its pieces from the plan,
never from the builders.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from omegaconf import DictConfig

from runner.build import (build_accelerator, build_environment, build_strategy, build_task, devices_setting,
                          logger_specs)
from runner.values import optimizer_nodes


@dataclass(frozen=True, eq=False)
class Plan:
    """The composed config, and what runner.build makes of it (each `cached_property`: worked out once)."""

    cfg: DictConfig

    @cached_property
    def accelerator(self) -> Any:
        return build_accelerator(self.cfg)

    @cached_property
    def environment(self) -> Any:
        """The cluster environment: who starts the processes (this job, or torchrun and srun), and how many."""
        return build_environment(self.cfg)

    @cached_property
    def devices(self) -> Any:
        """`trainer.devices` as the accelerator reads it (`auto` under torchrun or srun: their processes per node)."""
        return devices_setting(self.cfg, self.environment)

    @cached_property
    def device_indices(self) -> list[int]:
        """The device of each of this node's processes. Read once the accelerator is known to be available: for
        `auto` and -1 its device count decides (stage=check's stand-in for a machine it is not run on included)."""
        return self.accelerator.parse_devices(self.devices)

    @cached_property
    def task(self) -> Any:
        """The task (a LightningModule's own steps, where the model is one); raises what its constructor raises."""
        return build_task(self.cfg)

    @cached_property
    def loggers(self) -> dict[str, DictConfig]:
        """`logger` as {name: settings}: one entry per chosen option, none for `none`."""
        return logger_specs(self.cfg)

    @cached_property
    def optimizers(self) -> dict[str, DictConfig]:
        """{the key a message names: the settings} of each optimizer: `optimizer`, or each `optimizer.<name>`."""
        return optimizer_nodes(self.cfg.optimizer)

    @cached_property
    def strategy(self) -> Any:
        """The strategy, built as each worker builds its own: how many processes, and who starts them (this job's
        launcher, or torchrun and srun). Where this process trains, it trains with this one."""
        return build_strategy(self.cfg)

    @property
    def processes(self) -> int:
        """The processes of the run on all its nodes."""
        return len(self.device_indices) * self.cfg.trainer.num_nodes
