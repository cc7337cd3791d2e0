"""The components against this machine and each other: devices, backend, precision, a trainable model, compile,
and the task's settings.

CLI → compose → [validate: these checks, after the signatures] → run folder → launch → worker → build → loop →
teardown. They build the accelerator, the cluster environment and (on the meta device) the model, as the workers
will, to find here what would otherwise fail in every worker.
"""

from __future__ import annotations

import inspect
import os
from typing import Iterator

import torch
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf

from runner.build import NO_DECAY, build_model, compile_arguments, no_decay_matches, python_rng_kept
from runner.checks.signatures import strategy_class
from runner.plan import Plan
from runner.values import one_line, suggest


def check_components(plan: Plan) -> Iterator[str]:
    from runner.strategies import DataParallelStrategy, SingleDeviceStrategy

    cfg, accelerator = plan.cfg, plan.accelerator
    kind = accelerator.device_type
    if not accelerator.is_available():
        yield (f"accelerator={kind} but no {kind.upper()} device is available here; "
               "use accelerator=cpu or accelerator=auto")
        return
    indices = plan.device_indices
    available = accelerator.auto_device_count()
    if kind != "cpu" and (not indices or max(indices) >= available):
        yield f"trainer.devices={cfg.trainer.devices} but only {available} {kind.upper()} device(s) are visible"
        return
    chosen = strategy_class(cfg)
    if chosen and issubclass(chosen, SingleDeviceStrategy) and len(indices) > 1:
        yield (f"trainer.devices={cfg.trainer.devices} needs strategy=ddp or strategy=dp "
               "(strategy=single runs on one device)")
    if chosen and issubclass(chosen, DataParallelStrategy) and kind == "cpu" and len(indices) > 1:
        yield (f"trainer.devices={cfg.trainer.devices} needs accelerator=cuda for strategy=dp "
               "(DataParallel splits batches over CUDA devices; use strategy=ddp on CPU)")
    if cfg.precision.get("precision") == "16-mixed" and kind == "cpu":
        yield ("precision=16-mixed needs accelerator=cuda (float16 autocast with loss scaling is for GPUs); "
               "on CPU use precision=bf16-mixed")
    start_method = cfg.strategy.get("start_method")
    if start_method is not None and start_method not in ("popen", "spawn", "fork", "forkserver"):
        yield f"strategy.start_method={start_method} is not allowed: use popen, spawn, fork or forkserver"
    from runner.strategies.ddp import stall_timeout_problem, timeout_problem

    yield from filter(None, [timeout_problem(cfg.strategy.timeout) if "timeout" in cfg.strategy else None,
                             stall_timeout_problem(cfg.strategy.get("stall_timeout"))])
    yield from plan.environment.validate_settings(len(indices), cfg.trainer.num_nodes)


# CPU processes per core this process may use beyond which a run is refused unless insisted on, and the count always
# allowed (a few processes to try DDP on a laptop): each process imports torch (~0.3 GB) and takes a core's time.
CPU_PROCESSES_PER_CORE, CPU_PROCESSES_ALLOWED = 4, 8


def check_cpu_processes(plan: Plan) -> Iterator[str]:
    """A CPU process count far beyond the cores this process may use (a typo, devices=1000) would start them all and
    take a shared machine down before the first one fails: refused unless `trainer.oversubscribe_cpu=true`, before
    the checks that build the strategy (its devices, one object per process)."""
    cfg = plan.cfg
    if plan.accelerator.device_type != "cpu" or plan.environment.creates_processes_externally:
        return  # GPUs are counted by check_components; torchrun or srun started the processes already
    processes = len(plan.device_indices)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = max(CPU_PROCESSES_ALLOWED, CPU_PROCESSES_PER_CORE * cores)
    if processes <= limit or cfg.trainer.get("oversubscribe_cpu", False):
        return
    yield (f"trainer.devices={cfg.trainer.devices} would start {processes} CPU processes, and this process may use "
           f"{cores} core{'s' if cores > 1 else ''} (os.sched_getaffinity): beyond {limit} they only slow one "
           f"another and can exhaust the machine's memory; use trainer.devices={cores} (one per core), or insist "
           "with trainer.oversubscribe_cpu=true")


def check_backend(plan: Plan) -> Iterator[str]:
    """strategy.process_group_backend against the accelerator: a backend its devices lack (nccl on CPU) or a
    misspelt one fails only in the workers, every rank with its own traceback."""
    backend = plan.cfg.strategy.get("process_group_backend")
    if backend is None or not torch.distributed.is_available():
        return
    accelerator = plan.accelerator
    kind = accelerator.device_type
    if not accelerator.is_available():
        return  # check_components says so
    capability = {name: devices for name, devices in torch.distributed.Backend.backend_capability.items()
                  if name not in ("fake", "undefined")}  # torch's own test stand-in, and the unset marker
    allowed = [name for name, devices in capability.items()
               if kind in devices and torch.distributed.is_backend_available(name)]
    # torch also takes one backend per device type: "cpu:gloo,cuda:nccl".
    pairs = dict(part.split(":", 1) if ":" in part else (kind, part) for part in str(backend).lower().split(","))
    name = pairs.get(kind)
    allowed_text = f"allowed with accelerator={kind}: {', '.join(allowed)}, or null (the device's default)"
    if name is None:
        reason = f"names no backend for {kind}"
    elif name not in capability:
        reason = f"is not a process group backend{suggest(name, list(capability))}"
    elif kind not in capability[name]:
        reason = f"does not run on {kind} ({name} runs on {', '.join(capability[name])})"
    elif name not in allowed:
        reason = "is not available in this build of torch"
    else:
        return
    yield f"strategy.process_group_backend={backend} {reason}; {allowed_text}"


def check_trainable(plan: Plan) -> Iterator[str]:
    """A model without a parameter to train, and `optimizer._no_decay_` entries that exempt none of its parameters
    (built on the meta device: shapes only, in milliseconds)."""
    cfg = plan.cfg
    if cfg.get("stage", "fit") != "fit":
        return  # validating, testing or predicting with a frozen model is fine
    entries, problem = _no_decay_entries(cfg)
    if problem:
        yield problem
    model = plan.meta_model
    if not isinstance(model, torch.nn.Module):
        return
    parameters = list(model.parameters())
    if not parameters:
        yield (f"model ({cfg.model._target_}) has no parameters: the optimizer would get an empty list and "
               "nothing would train (stage=validate, test or predict run a model without training it)")
    elif not any(p.requires_grad for p in parameters):
        yield (f"model ({cfg.model._target_}) has no trainable parameters: all {len(parameters)} have "
               "requires_grad=False, so the optimizer would change nothing; leave some trainable")
    for entry, names in no_decay_matches(model, entries).items():
        if not names:
            some = ", ".join(name for name, _ in list(model.named_parameters())[:6])
            yield (f"optimizer.{NO_DECAY}: {entry} matches no parameter of model ({cfg.model._target_}); use bias "
                   f"(names ending in bias), norm (normalization layers) or part of a name such as {some}")


def _no_decay_entries(cfg: DictConfig) -> tuple[list[str], str]:
    """`optimizer._no_decay_` as a list of names, or a problem: not a list of names, an optimizer without
    weight_decay or with none set (the exemption would change nothing)."""
    node = cfg.optimizer
    value = node.get(NO_DECAY)
    if value is None or (OmegaConf.is_list(value) and len(value) == 0):
        return [], ""
    entries = list(value) if OmegaConf.is_list(value) else None
    if entries is None or not all(isinstance(e, str) and e for e in entries):
        return [], (f"optimizer.{NO_DECAY}={value} must be a list of names: bias, norm, or part of a parameter's "
                    "name, e.g. optimizer._no_decay_=[bias,norm]")
    target = get_method(node._target_)
    takes = inspect.isclass(target) and "weight_decay" in (inspect.signature(target).parameters)
    if not takes:
        return [], f"optimizer.{NO_DECAY}={value}: optimizer ({node._target_}) takes no weight_decay to exempt from"
    decay = node.get("weight_decay", inspect.signature(target).parameters["weight_decay"].default)
    if isinstance(decay, (int, float)) and not isinstance(decay, bool) and decay == 0:
        return [], (f"optimizer.{NO_DECAY}={value} exempts parameters from a weight decay of 0: set "
                    "optimizer.weight_decay (e.g. +optimizer.weight_decay=0.01 for sgd), or leave _no_decay_ out")
    return [str(e) for e in entries], ""


def check_half_optimizer(plan: Plan) -> Iterator[str]:
    """float16 rounds an epsilon below ~3e-8 to 0; Adam-style updates then divide by zero and the loss turns NaN."""
    cfg = plan.cfg
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


def check_compile(plan: Plan) -> Iterator[str]:
    from runner.strategies import DataParallelStrategy

    cfg = plan.cfg
    arguments = compile_arguments(cfg)
    if arguments is None:
        return
    try:
        inspect.signature(torch.compile).bind(None, **arguments)
    except TypeError as error:
        allowed = ", ".join(p for p in inspect.signature(torch.compile).parameters if p != "model")
        yield f"trainer.compile={arguments}: {error} (torch.compile takes {allowed})"
    chosen = strategy_class(cfg)
    if chosen and issubclass(chosen, DataParallelStrategy):
        yield ("trainer.compile needs strategy=single or strategy=ddp: DataParallel copies the module to every "
               "device at every step, and the copies would run the original's compiled code")


def check_task(plan: Plan) -> Iterator[str]:
    cfg = plan.cfg
    try:
        plan.task  # built at its first reading, this one; the checkpoint's check reads the same
    except Exception as error:  # noqa: BLE001 - any refusal of the arguments is the user's to fix
        yield f"task ({cfg.task.get('_target_')}) does not accept its settings: {one_line(error)}"
    yield from check_lightning(plan)


def check_lightning(plan: Plan) -> Iterator[str]:
    """What of a LightningModule or a Lightning callback the runner does not run (runner.lightning.checks)."""
    from runner.lightning.checks import config_problems

    def meta_model() -> torch.nn.Module:
        # Its own build: a LightningModule's configure_optimizers() runs on it, which may change what the other
        # checks read of the plan's (requires_grad, attributes).
        with torch.random.fork_rng(devices=[]), python_rng_kept(), torch.device("meta"):
            return build_model(plan.cfg)
    yield from config_problems(plan.cfg, meta_model, strategy_class(plan.cfg))
