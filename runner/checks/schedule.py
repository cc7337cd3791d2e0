"""The data and the schedule: what the loop reads from the data, its first batches, and the optimizer and scheduler
probed over the steps the run will take.

CLI → compose → [validate: these checks, after the components] → run folder → launch → worker → build → loop →
teardown. The data is built here only where that costs no build of its own: for the worker of this process, which
then takes it (runner.build.DataHandOver), or outside a job (validate called alone). The optimizer is built over one
parameter, and the scheduler stepped as the loop would step it.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Iterator, Optional

import torch
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf

from runner.build import (build_scheduler, build_unchecked_data, data_contract, data_hand_over, first_batches_problem,
                          global_rng_states, probe_optimizer, python_rng_kept)
from runner.config import ConfigError
from runner.plan import Plan
from runner.values import is_int, one_line


def check_data_and_schedule(plan: Plan) -> Iterator[str]:
    """The data, where built here (see _trial_data): what the loop reads from it, whether its first samples form a
    batch, and the schedule's rates over the steps the run will take with it."""
    from runner.data import is_data_module, ready

    cfg = plan.cfg
    data = _trial_data(cfg)
    if data is not None and is_data_module(data):
        data = None  # its data sets exist once each worker has run its prepare_data and setup
    try:
        data = ready(data, cfg.get("stage", "fit")) if data is not None else None  # loaders read as a worker does
    except ConfigError as error:
        yield from error.problems
        data = None
    problem = data is not None and (data_contract(cfg, data) or first_batches_problem(cfg, data))
    if problem:
        yield problem
        data = None
    yield from _check_optimizer_and_scheduler(plan, _planned_steps(plan, data))


# The runner's own data sets, made in memory from their settings in milliseconds: built before launch even where the
# launched workers build their own, for what only the built data tells (the run's length, for the schedule's check).
_BUILT_IN_DATA = "runner.data."


def _trial_data(cfg: DictConfig) -> Any:
    """The data object, built here for the checks of its first batches and of the run's length, and offered to the
    worker of this process; None where building it here would be a build more than the workers make (each checks its
    own after building it), or where it cannot be built (each worker reports its own errors).

    A build more: a data module (its data sets exist only after each worker's setup), or, in a job whose workers are
    launched processes, a user's data (it may tokenise or download in its constructor), unless built in.
    """
    hand_over = data_hand_over()  # None outside a job: validate alone builds what it checks
    if _makes_data_in_setup(cfg) or (hand_over is not None and not hand_over.trains_here()
                                     and not str(cfg.data.get("_target_")).startswith(_BUILT_IN_DATA)):
        return None
    with torch.random.fork_rng(devices=[]), python_rng_kept(), _quiet_runner_log():
        before = global_rng_states()
        try:
            data = build_unchecked_data(cfg)
        except Exception:  # noqa: BLE001 - reported by the workers, where the data is built for the run
            return None
        drew_random = global_rng_states() != before
    if hand_over is not None and hand_over.trains_here():
        hand_over.offer(cfg, data, drew_random)
    return data


def _makes_data_in_setup(cfg: DictConfig) -> bool:
    """Whether the data's class is a data module (prepare_data/setup), known without building it."""
    from runner.data import is_data_module

    try:
        return is_data_module(get_method(str(cfg.data._target_)))
    except Exception:  # noqa: BLE001 - not importable: the static checks say so
        return False


def _planned_steps(plan: Plan, data: Any) -> Optional[int]:
    """The optimizer steps a fit takes from step 0, counted as the worker counts them (its scheduler's
    total_steps); None when not known here: no data, and trainer.max_steps alone does not decide."""
    from runner.loop import make_schedule

    t = plan.cfg.trainer
    if plan.cfg.get("stage", "fit") != "fit":
        return None
    steps_alone = t.max_steps if t.max_epochs is None and t.max_steps != -1 and not t.fast_dev_run else None
    try:
        processes = len(plan.device_indices)
    except Exception:  # noqa: BLE001 - devices this machine lacks: check_components says so
        processes = 0
    if data is None or processes < 1:
        return steps_alone
    size = _epoch_samples(data)
    if size is None:  # a stream that does not say its length: trainer.max_steps decides (the loop insists)
        return steps_alone
    # Each process takes len // processes samples (the sampler drops the tail), in whole batches.
    batches = size // (processes * t.num_nodes) // data.batch_size
    total = make_schedule(t, batches, 0).total_steps
    return total if total >= 1 else None


def _epoch_samples(data: Any) -> Optional[int]:
    """The samples of a training epoch: the training loader's own sampler's, a stream's (None: unknown), or the
    set's."""
    from runner.data.streams import is_stream, stream_length

    sampler = getattr(data, "split_settings", {}).get("train", {}).get("sampler")
    if sampler is not None:
        return len(sampler)
    dataset = data.train_dataset
    return stream_length(dataset) if is_stream(dataset) else len(dataset)


# What a constructor raises for values it refuses (ZeroDivisionError: StepLR's step_size=0 at its first step).
_REFUSALS = (TypeError, ValueError, RuntimeError, KeyError, IndexError, ZeroDivisionError, OverflowError)


# A schedule over more planned steps is probed over its first ones only: a scheduler step costs microseconds.
_PROBED_STEPS = 200_000


def _check_optimizer_and_scheduler(plan: Plan, planned: Optional[int] = None) -> Iterator[str]:
    """Both built over one parameter, and the scheduler stepped over the run's `planned` optimizer steps (a few
    when they are not known here): its arithmetic runs at its steps, and the rates it gives must train."""
    from runner.schedulers import learning_rates

    cfg, probes = plan.cfg, []
    for key, node in plan.optimizers.items():  # one, or each named optimizer
        try:
            probes.append(probe_optimizer(node, [torch.zeros(1, requires_grad=True)]))
        except _REFUSALS as error:
            yield f"{key} ({node._target_}) does not accept its settings ({_settings(key, node)}): {one_line(error)}"
            return
    if None in probes:
        return
    if len(probes) == 1 and "_target_" in cfg.optimizer:
        optimizer = probes[0]
    else:
        from runner.loop.optimizers import OptimizerSet  # the loop package: only where several optimizers are named

        optimizer = OptimizerSet(probes)
    steps = list(_check_scheduler_steps(cfg))
    if steps:
        yield from steps
        return
    probed = min(planned, _PROBED_STEPS) if planned else 3
    try:
        with warnings.catch_warnings(), _quiet_runner_log():
            warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": no training here
            # Without the planned count a stand-in; the worker passes the real one (and warns).
            scheduler = build_scheduler(cfg, optimizer, total_steps=planned or max(cfg.trainer.max_steps, 2))
            rates = learning_rates(scheduler, probed)
    except ConfigError as error:
        yield from error.problems
        return
    except _REFUSALS as error:
        steps = f"within the run's {planned} optimizer steps" if planned else "on its first steps"
        settings = _settings("scheduler", cfg.scheduler)
        yield (f"scheduler ({cfg.scheduler._target_}) fails {steps}{f' with {settings}' if settings else ''}: "
               f"{one_line(error)}")
        return
    if planned:
        yield from _check_rates(cfg, rates, planned, optimizer)


def _check_rates(cfg: DictConfig, rates: list[float], planned: int, optimizer: Any) -> Iterator[str]:
    """The rates a schedule gives over the run's planned steps, named with the scheduler's settings."""
    from runner.schedulers import schedule_problem

    problem = schedule_problem(rates, planned, _reference_lr(cfg, optimizer))
    if problem:
        told = cfg.scheduler.get("total_steps")
        hint = (f" (scheduler.total_steps={told}, the run {planned}: leave scheduler.total_steps out and the runner "
                "passes the run's count)" if told is not None and told != planned else "")
        yield (f"scheduler ({cfg.scheduler._target_}: {_settings('scheduler', cfg.scheduler) or 'its defaults'}) "
               f"with optimizer.lr={optimizer.defaults.get('lr', 0.0):g}: {problem}{hint}")


# Settings of torch's schedulers counted in optimizer steps, which their constructors take unchecked, with the least
# value each means anything at (StepLR's step_size=-1 multiplies by gamma at every step).
_STEP_COUNTS = {"step_size": 1, "step_size_up": 1, "step_size_down": 1, "T_max": 1, "T_0": 1, "T_mult": 1,
                "total_iters": 0}


def _check_scheduler_steps(cfg: DictConfig) -> Iterator[str]:
    """Step counts below what they mean anything at, before a probe steps the scheduler with them."""
    for key, least in _STEP_COUNTS.items():
        value = cfg.scheduler.get(key)
        if is_int(value) and value < least:
            yield (f"scheduler.{key}={value} must be a number of optimizer steps, at least {least} "
                   f"({cfg.scheduler._target_})")


def _reference_lr(cfg: DictConfig, optimizer: Any) -> float:
    """What a schedule's rates are measured against: optimizer.lr, or a peak the scheduler sets itself (max_lr)."""
    peak = cfg.scheduler.get("max_lr")
    peaks = list(peak) if OmegaConf.is_list(peak) else [peak] if isinstance(peak, (int, float)) else []
    return max([float(optimizer.defaults.get("lr", 0.0)), *(float(p) for p in peaks)])


def _settings(group: str, node: DictConfig) -> str:
    """`group.key=value, ...` for the node's plain values: the keys a message about them should name."""
    values = OmegaConf.to_container(node, resolve=True)
    return ", ".join(f"{group}.{k}={v}" for k, v in values.items()
                     if not str(k).startswith("_") and isinstance(v, (bool, int, float, str, type(None))))


@contextlib.contextmanager
def _quiet_runner_log() -> Iterator[None]:
    """A trial build's log lines are not the run's."""
    runner_log = logging.getLogger("runner")
    disabled, runner_log.disabled = runner_log.disabled, True
    try:
        yield
    finally:
        runner_log.disabled = disabled
