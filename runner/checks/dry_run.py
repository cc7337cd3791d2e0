"""The check stage (`stage=check`): every check of `validate`, the first batch of data.batch_size samples through the
model and task (or a LightningModule's steps, see runner.checks.trial), and what the run would hold per process;
nothing launched, trained or written.

CLI → compose → [validate → first batch → report] and stop: what CI calls instead of a short run. The config is
checked as the training run it describes (stage=fit), in this one process, whatever the number of processes or
devices it asks for: CPU "devices" cost nothing to name, and CUDA devices this machine lacks are stood in for
(`machine_stand_in`), the device check skipped with one line.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Any, Iterator, Literal, Optional
from unittest import mock

import torch
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf, open_dict

from runner.build import build_data, build_model, handing_over_data, python_rng_kept
from runner.checks import validate_plan
from runner.config import ConfigError
from runner.plan import Plan
from runner.values import one_line

log = logging.getLogger("runner")

# `check`: the config, its objects and the first batch of data built by its constructor; `check_data`: also a data
# module's prepare_data() and setup("fit") (downloads, caches), and its first batch.
CHECK_STAGES = ("check", "check_data")
CheckStage = Literal["check", "check_data"]

# States an optimizer keeps per parameter, each of the parameter's size: (class, states, extra state when set).
_OPTIMIZER_STATES = (
    (torch.optim.Adam, 2, "amsgrad"), (torch.optim.AdamW, 2, "amsgrad"), (torch.optim.NAdam, 2, None),
    (torch.optim.RAdam, 2, None), (torch.optim.Adamax, 2, None), (torch.optim.Adadelta, 2, None),
    (torch.optim.Adagrad, 1, None), (torch.optim.SGD, 0, "momentum"), (torch.optim.RMSprop, 1, "momentum"),
)
_BYTES = {"64-true": 8, "16-true": 2, "bf16-true": 2}  # weights' bytes per value; the others (mixed too) keep fp32


def training_config(cfg: DictConfig) -> DictConfig:
    """`cfg` as the training run it describes: a copy with stage=fit, which every check knows."""
    checked = cfg.copy()
    with open_dict(checked):
        checked.stage = "fit"
    return checked


def check_config(cfg: DictConfig, folder: Optional[Path] = None) -> dict:
    """Raise ConfigError listing every problem of `cfg` (stage=check or check_data); else return what was learned:
    `parameters`, `trainable`, `first_batch` (what ran on it), `gflop_per_sample` (None when not counted), the
    per-process bytes and the report line (`report`), which is also logged. `folder`: where the training run's
    `trainer.ckpt_path=last|best` is looked for (none: its checkpoint is not checked)."""
    stage = cfg.get("stage", "check")
    checked = training_config(cfg)
    plan = Plan(checked, folder, records=False)
    with machine_stand_in(plan) as skipped, handing_over_data(lambda: True), dynamo_left_unimported():
        validate_plan(plan)
        data = _checked_data(checked, with_setup=stage == "check_data")
        findings = measure(plan, data)
    findings["report"] = report_line(findings)
    if skipped:
        log.warning("check: %s", skipped)
        findings["device_check"] = "skipped"
    log.info("%s", findings["report"])
    return findings


@contextlib.contextmanager
def dynamo_left_unimported() -> Iterator[None]:
    """torch's Python meta kernels (its decompositions and their type-promotion wrappers, which the meta passes over
    the first batch run) import torch._dynamo on their first call only to run under torch._dynamo.disable, which
    changes nothing where nothing compiles: about 0.8 s of CPU, a fifth of the check. While the check runs, torch's
    cache of each one's disabled version (`fn.__dynamo_disable`, see torch._compile._disable_dynamo) holds the
    function itself; afterwards it is emptied again, so a later compile in this process finds torch as it was. Left
    alone where torch._dynamo is imported already, or where torch's wrapper is not the one known here."""
    seeded = [] if "torch._dynamo" in sys.modules else _seed_dynamo_disable()
    try:
        yield
    finally:
        for fn in seeded:
            if fn.__dict__.get("__dynamo_disable") is fn:
                del fn.__dynamo_disable


def _seed_dynamo_disable() -> list:
    import gc
    import types

    import torch._compile
    import torch.utils.flop_counter  # its import makes wrapped kernels of its own: seeded too

    inner = next((c for c in torch._compile._disable_dynamo.__code__.co_consts
                  if isinstance(c, types.CodeType) and c.co_name == "inner"), None)
    if inner is None or "fn" not in inner.co_freevars or "__dynamo_disable" not in inner.co_names:
        return []
    cell = inner.co_freevars.index("fn")
    seeded = []
    for wrapper in gc.get_referrers(inner):  # the wrappers refer to their code; a scan in C, not over every object
        if type(wrapper) is types.FunctionType and wrapper.__code__ is inner:
            fn = wrapper.__closure__[cell].cell_contents
            if callable(fn) and hasattr(fn, "__dict__") and "__dynamo_disable" not in fn.__dict__:
                fn.__dynamo_disable = fn
                seeded.append(fn)
    return seeded


def _checked_data(cfg: DictConfig, with_setup: bool) -> Any:
    """The data (the checks' own build, handed over) after build_data's checks: contract, first batches, and the
    model and task over two samples. None for a data module unless `with_setup`; its setup reads a trainer view (one
    process, as the check runs)."""
    from runner.data import is_data_module
    from runner.lightning.trainer_view import TrainerView

    try:
        module = is_data_module(get_method(str(cfg.data._target_)))
    except Exception:  # noqa: BLE001 - validate names a target that does not import
        module = False
    if module and not with_setup:
        return None
    quiet = log.level
    log.setLevel(logging.WARNING)  # build_data's words on a build for training do not concern a check
    try:
        return build_data(cfg, trainer=TrainerView(cfg))
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - its constructor, prepare_data or setup: one line, not a traceback
        raise ConfigError([f"data ({cfg.data._target_}) cannot be built: {one_line(error)}"]) from error
    finally:
        log.setLevel(quiet)


@contextlib.contextmanager
def machine_stand_in(plan: Plan) -> Iterator[Optional[str]]:
    """CUDA devices the config asks for and this machine lacks, stood in for while the checks run: the devices
    count as present (nothing runs on them: the model is built on the meta device). Yields the line saying the
    device check was skipped, or None when this machine has what the config asks for. Reads the plan's devices
    setting, not its device indices: those are the stand-in's, read by the checks."""
    accelerator = plan.accelerator
    if accelerator.device_type == "cpu":
        yield None
        return
    setting = plan.devices
    present = accelerator.auto_device_count() if accelerator.is_available() else 0
    wanted = _devices_wanted(setting, present)
    if wanted <= present:
        yield None
        return
    kind = type(accelerator)
    with mock.patch.object(kind, "is_available", lambda self: True), \
            mock.patch.object(kind, "auto_device_count", lambda self: wanted):
        yield (f"accelerator={accelerator.device_type} with trainer.devices={setting}: this machine has {present} "
               f"{accelerator.device_type.upper()} device(s), so the device check was skipped; the rest was checked "
               f"as on a machine with {wanted}")


def _devices_wanted(setting: Any, present: int) -> int:
    if OmegaConf.is_list(setting) or isinstance(setting, (list, tuple)):
        return max(int(i) for i in setting) + 1
    if setting in ("auto", -1, "-1"):
        return max(present, 1)
    return int(setting)


def measure(plan: Plan, data: Any) -> dict:
    """Parameters (trainable and frozen) of the model built on the meta device, the first batch's trial (what ran,
    its FLOPs per sample; runner.checks.trial), and the bytes per process its run would hold."""
    from runner.checks.trial import first_batch_trial
    from runner.lightning import is_lightning_config

    cfg, model = plan.cfg, plan.meta_model
    if model is None:  # the meta device cannot build it: its error, raised by the build
        with torch.random.fork_rng(devices=[]), python_rng_kept(), torch.device("meta"):
            model = build_model(cfg)
    parameters = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    trainable = sum(p.numel() for p in parameters if p.requires_grad)
    total = sum(p.numel() for p in parameters)
    trial = first_batch_trial(plan, data)
    findings = {"parameters": total, "trainable": trainable, "first_batch": trial.tried,
                "gflop_per_sample": trial.gflop_per_sample, "flops_not_counted": trial.not_counted}
    findings.update(per_process_memory(plan, total, trainable, optimizer_state_elements(cfg, model, trainable)))
    lightning = is_lightning_config(cfg)
    findings["optimizer_state_unknown"] = ("its configure_optimizers() chooses the optimizer" if lightning
                                           else "an optimizer this check does not know")
    return findings


def per_process_memory(plan: Plan, total: int, trainable: int, state_elements: Optional[int]) -> dict:
    """Bytes of weights, gradients and optimizer state in each process: ddp (and dp, single) keeps all of them in
    every process, fsdp a 1/world-size share; optimizer state None where its class is not known here."""
    cfg, strategy = plan.cfg, plan.strategy
    processes = strategy.processes.count if strategy.processes is not None else 1
    external = getattr(strategy, "cluster_environment", None)
    if external is not None and external.creates_processes_externally:
        world = external.world_size()
    else:
        world = processes * cfg.trainer.num_nodes
    name = type(strategy).__name__.replace("Strategy", "").lower().replace("singledevice", "single")
    name = {"dataparallel": "dp"}.get(name, name)
    share = world if name == "fsdp" else 1
    precision = str(cfg.precision.get("precision", "32-true"))
    size = _BYTES.get(precision, 4)
    return {"strategy": name, "world_size": world, "precision": precision,
            "weights_bytes": total * size / share, "gradients_bytes": trainable * size / share,
            "optimizer_state_bytes": None if state_elements is None else state_elements * size / share}


def optimizer_state_elements(cfg: DictConfig, model: Any, trainable: int) -> Optional[int]:
    """The numbers the optimizer keeps per process before sharding: its states per parameter times the trainable
    parameters, for each named optimizer over its own part; None where an optimizer's class is not known here."""
    from runner.lightning import is_lightning_config
    from runner.values import named_optimizers

    if is_lightning_config(cfg) or "optimizer" not in cfg or cfg.optimizer is None:
        return None  # a LightningModule's configure_optimizers() chooses
    parts = named_optimizers(cfg.optimizer)
    if parts is None:
        states = _optimizer_states(cfg.optimizer)
        return None if states is None else states * trainable
    from runner.loop.optimizers import assign_parts

    if not isinstance(model, torch.nn.Module):
        return None
    taken, problems = assign_parts(model, parts)
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    counts = [_optimizer_states(node) for node in parts.values()]
    if problems or None in counts:
        return None
    return sum(states * sum(sizes[n] for n in taken[name]) for states, name in zip(counts, parts))


def _optimizer_states(node: Any) -> Optional[int]:
    try:
        target = get_method(str(node._target_))
    except Exception:  # noqa: BLE001
        return None
    for kind, states, extra in _OPTIMIZER_STATES:
        if isinstance(target, type) and issubclass(target, kind):
            return states + (1 if extra and node.get(extra) else 0)
    return None


def report_line(findings: dict) -> str:
    """`check: ok — model 0.53M parameters (0.53M trainable), a first batch (64 samples) ran forward and backward on
    the CPU, 2.4e-06 GFLOP per sample; per process (ddp, 8 processes, 32-true): weights 2.0 MiB, gradients 2.0 MiB,
    optimizer state 4.1 MiB`."""
    flops, why_not = findings["gflop_per_sample"], findings["flops_not_counted"]
    flops_text = (f"{flops:.2g} GFLOP per sample" if flops is not None
                  else f"FLOPs not counted{f' ({why_not})' if why_not else ''}")
    state = findings["optimizer_state_bytes"]
    state_text = _size(state) if state is not None else f"not estimated ({findings['optimizer_state_unknown']})"
    world = findings["world_size"]
    processes = f"{world} process{'es' if world > 1 else ''}"
    return (f"check: ok — model {_count(findings['parameters'])} parameters ({_count(findings['trainable'])} "
            f"trainable), {findings['first_batch']}, {flops_text}; per process ({findings['strategy']}, {processes}, "
            f"{findings['precision']}): weights {_size(findings['weights_bytes'])}, gradients "
            f"{_size(findings['gradients_bytes'])}, optimizer state {state_text}")


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e5 else f"{n / 1e3:.3g}k" if n >= 1e3 else str(n)


def _size(size: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} B"
