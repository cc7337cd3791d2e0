"""What a run will build, each piece worked out once from the composed config, for the checks and the job to read.

CLI → compose → [plan] → validate (the checks read the plan) → run folder → launch (from the plan's strategy) →
worker → build → loop → teardown. A piece is worked out by the module that owns it (runner.build, as the workers will;
runner.checkpoint_search; runner.launch's choice of launcher) at its first reading and then kept: the checks that read
it run after the ones that make building it safe (the config's keys, its plain values, the signatures), so a config
refused by those builds nothing here. A check reads its pieces from the plan, never from the builders.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from runner.build import (build_accelerator, build_environment, build_strategy, build_task, devices_setting,
                          logger_specs, meta_model)
from runner.checkpoint_search import resolve_ckpt_path
from runner.launch import launcher_for
from runner.stages import record_dir
from runner.values import optimizer_nodes


@dataclass(frozen=True, eq=False)
class Plan:
    """The composed config, and what runner.build makes of it (each `cached_property`: worked out once).

    `folder`: the run folder a job was given (None: a config checked alone). Its stage records there, or in a folder
    of its own inside a fit's (`run_dir`), unless `records` is False (stage=check, which writes nothing and only
    looks there for `trainer.ckpt_path=last|best`). `checkpoint`: for a config checked alone, a checkpoint file to
    check it against (validate's)."""

    cfg: DictConfig
    folder: Optional[Path] = None
    records: bool = True
    checkpoint: Optional[str] = None

    @cached_property
    def ckpt_path(self) -> Optional[str]:
        """The checkpoint file the run starts from or evaluates (None: none): `trainer.ckpt_path`, with `last` and
        `best` looked for in the folder, then in the runs of this config (runner.checkpoint_search); a ConfigError
        where neither holds one the stage needs."""
        return self.checkpoint if self.folder is None else resolve_ckpt_path(self.cfg, self.folder)

    @cached_property
    def run_dir(self) -> Optional[Path]:
        """Where this stage writes its record (runner.stages.record_dir); None where it writes nothing."""
        if self.folder is None or not self.records:
            return None
        return record_dir(str(self.cfg.get("stage", "fit")), self.folder)

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
    def meta_model(self) -> Any:
        """The model on the meta device (shapes only, the random generators left as they were), for the checks that
        read its parameters, names and classes; None where the meta device cannot build it (the workers then report
        what fails). The checks read it and never change it (the Lightning checks, which call the module's
        configure_optimizers(), build their own); `release_trials` lets it go."""
        return meta_model(self.cfg)

    def release_trials(self) -> None:
        """Let go of what only the checks read (the model on the meta device), before the run trains in this
        process: a later reading builds it again."""
        vars(self).pop("meta_model", None)

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
    def external(self) -> bool:
        """Whether the strategy's processes were started outside this job (torchrun, srun): each runs a job of its
        own."""
        environment = getattr(self.strategy, "cluster_environment", None)
        return bool(environment is not None and environment.creates_processes_externally)

    @cached_property
    def launcher(self) -> Any:
        """What starts the workers (runner.launch.launcher_for): None where this process trains (one process; a rank
        that torchrun or srun started)."""
        return launcher_for(self.strategy.processes, self.cfg.trainer.get("max_restarts", 0), self.external)

    @cached_property
    def resolved(self) -> DictConfig:
        """The config the workers build from: interpolations resolved and `auto` choices made once, here (the
        cluster environment the strategy found; `trainer.ckpt_path` the file found)."""
        resolved = OmegaConf.to_container(self.cfg, resolve=True)
        resolved.pop("hydra", None)
        environment = getattr(self.strategy, "cluster_environment", None)
        if environment is not None:
            resolved["cluster"] = {"_target_": f"{type(environment).__module__}.{type(environment).__qualname__}"}
        resolved["trainer"]["ckpt_path"] = self.ckpt_path
        return OmegaConf.create(resolved)

    @property
    def processes(self) -> int:
        """The processes of the run on all its nodes."""
        return len(self.device_indices) * self.cfg.trainer.num_nodes

