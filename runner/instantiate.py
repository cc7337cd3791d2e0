"""The one place a composed config becomes objects (the only caller of hydra.utils.instantiate)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from runner.config import ConfigError, check_static


def build_accelerator(cfg: DictConfig) -> Any:
    return instantiate(cfg.accelerator)


def build_precision(cfg: DictConfig, accelerator: Any) -> Any:
    # `device: auto` in the mixed-precision options follows the accelerator (autocast needs its device type).
    if cfg.precision.get("device") == "auto":
        return instantiate(cfg.precision, device=accelerator.device_type)
    return instantiate(cfg.precision)


def build_strategy(cfg: DictConfig) -> Any:
    """accelerator -> precision -> checkpoint IO -> cluster environment -> strategy, as its constructor arguments."""
    accelerator = build_accelerator(cfg)
    devices = accelerator.get_parallel_devices(cfg.trainer.devices)
    precision = build_precision(cfg, accelerator)
    offers = {
        "accelerator": accelerator,
        "parallel_devices": devices,
        "device": devices[0],
        "cluster_environment": instantiate(cfg.cluster),
        "checkpoint_io": instantiate(cfg.checkpoint_io),
        "precision": precision,
        "precision_plugin": precision,
    }
    # Each strategy takes the components its constructor names (DP calls precision `precision_plugin`).
    accepted = inspect.signature(get_method(cfg.strategy._target_)).parameters
    return instantiate(cfg.strategy, **{k: v for k, v in offers.items() if k in accepted})


def build_model(cfg: DictConfig) -> Any:
    return instantiate(cfg.model)


def build_data(cfg: DictConfig) -> Any:
    return instantiate(cfg.data)


def build_loss(cfg: DictConfig) -> Any:
    return instantiate(cfg.loss)


def build_optimizer(cfg: DictConfig, parameters: Any) -> Any:
    return instantiate(cfg.optimizer)(parameters)


def build_scheduler(cfg: DictConfig, optimizer: Any) -> Any:
    return instantiate(cfg.scheduler)(optimizer)


def build_logger(cfg: DictConfig, run_dir: Path, enabled: bool) -> Any:
    """Rank 0 gets the configured logger; the other ranks a logger that does nothing."""
    from runner.loggers import NullLogger

    return instantiate(cfg.logger, root_dir=str(run_dir)) if enabled else NullLogger()


# -- checks that need the hardware or the cluster ----------------------------------------------------

def _check_components(cfg: DictConfig) -> Iterator[str]:
    from runner.strategies import DataParallelStrategy, SingleDeviceStrategy

    accelerator = build_accelerator(cfg)
    kind = accelerator.device_type
    if not accelerator.is_available():
        yield (f"accelerator={kind} but no {kind.upper()} device is available here; "
               "use accelerator=cpu or accelerator=auto")
        return
    indices = accelerator.parse_devices(cfg.trainer.devices)
    available = accelerator.auto_device_count()
    if kind != "cpu" and (not indices or max(indices) >= available):
        yield f"trainer.devices={cfg.trainer.devices} but only {available} {kind.upper()} device(s) are visible"
        return
    strategy_class = get_method(cfg.strategy._target_)
    strategy_class = strategy_class if inspect.isclass(strategy_class) else None
    if strategy_class and issubclass(strategy_class, SingleDeviceStrategy) and len(indices) > 1:
        yield (f"trainer.devices={cfg.trainer.devices} needs strategy=ddp or strategy=dp "
               "(strategy=single runs on one device)")
    if strategy_class and issubclass(strategy_class, DataParallelStrategy) and kind == "cpu" and len(indices) > 1:
        yield (f"trainer.devices={cfg.trainer.devices} needs accelerator=cuda for strategy=dp "
               "(DataParallel splits batches over CUDA devices; use strategy=ddp on CPU)")
    if cfg.precision.get("precision") == "16-mixed" and kind == "cpu":
        yield ("precision=16-mixed needs accelerator=cuda (float16 autocast with loss scaling is for GPUs); "
               "on CPU use precision=bf16-mixed")
    start_method = cfg.strategy.get("start_method")
    if start_method is not None and start_method not in ("popen", "spawn", "fork"):
        yield f"strategy.start_method={start_method} is not allowed: use popen, spawn or fork"
    timeout = cfg.strategy.get("timeout")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        yield f"strategy.timeout={timeout} must be a positive number of seconds"
    yield from instantiate(cfg.cluster).validate_settings(len(indices), cfg.trainer.num_nodes)


def _check_half_optimizer(cfg: DictConfig) -> Iterator[str]:
    """float16 rounds an epsilon below ~3e-8 to 0; Adam-style updates then divide by zero and the loss turns NaN."""
    optimizer = cfg.get("optimizer")
    if cfg.precision.get("precision") != "16-true" or not OmegaConf.is_dict(optimizer) or "_target_" not in optimizer:
        return
    eps = optimizer.get("eps")
    if eps is None:
        default = inspect.signature(get_method(optimizer._target_)).parameters.get("eps")
        eps = default.default if default is not None else None
    if isinstance(eps, (int, float)) and eps > 0 and torch.tensor(eps, dtype=torch.float16).item() == 0:
        key = "optimizer.eps" if "eps" in optimizer else "+optimizer.eps"
        yield (f"precision=16-true with optimizer eps={eps}: float16 rounds it to 0, so the first updates "
               f"overflow; set {key}=1e-4, or use precision=bf16-true or bf16-mixed")


def _check_checkpoint(path: Any) -> Iterator[str]:
    from runner.checkpoint_io import CheckpointError, TorchCheckpointIO

    try:
        checkpoint = TorchCheckpointIO().load_checkpoint(path, map_location="cpu")
    except CheckpointError as err:
        yield f"trainer.ckpt_path={path}: {err}"
        return
    missing = [key for key in ("model", "optimizer", "step") if key not in checkpoint]
    if missing:
        yield f"trainer.ckpt_path={path} is not a runner checkpoint: it lacks {', '.join(missing)}"


def validate(cfg: DictConfig, ckpt_path: Any = None) -> None:
    """Raise ConfigError listing every problem of `cfg`; nothing is started before this passes."""
    problems = check_static(cfg)
    if not problems:  # component checks build objects, which needs importable, well-typed settings
        problems += _check_components(cfg)
        problems += _check_half_optimizer(cfg)
    if ckpt_path is not None:
        problems += _check_checkpoint(ckpt_path)
    if problems:
        raise ConfigError(problems)


