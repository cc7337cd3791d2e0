"""Learning-rate schedules over the run's optimizer steps, which the runner counts (no arithmetic in configs).

Each takes `total_steps`: the optimizer steps the run will take after processes, accumulation, epochs and
`trainer.max_steps` are accounted for. The runner passes it when the config leaves it out, so a schedule
ends where the run ends on any number of processes. Each is a LambdaLR stepped once per optimizer step;
its state (the step count) is checkpointed with the run.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def _check(total_steps: int, warmup_steps: int, floor: float, floor_name: str) -> None:
    if not (isinstance(total_steps, int) and total_steps >= 1):
        raise ValueError(f"scheduler.total_steps={total_steps} must be a positive number of optimizer steps")
    if not (isinstance(warmup_steps, int) and warmup_steps >= 0):
        raise ValueError(f"scheduler.warmup_steps={warmup_steps} must be 0 or a positive number of optimizer steps")
    # A warning, not an error: a smoke test of a config runs a few steps. Said once, by the first process.
    first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if warmup_steps >= total_steps and first:
        logging.getLogger("runner").warning(
            "scheduler.warmup_steps=%d is not below this run's %d optimizer steps (scheduler.total_steps): the rate "
            "rises for the whole run and never decays; warm up over fewer steps, or train for more",
            warmup_steps, total_steps)
    if not (isinstance(floor, (int, float)) and 0.0 <= floor <= 1.0):
        raise ValueError(f"scheduler.{floor_name}={floor} must be a fraction of the initial rate in [0, 1]")


def _warmup_then(total_steps: int, warmup_steps: int, decay: Callable[[float], float]) -> Callable[[int], float]:
    """Linear warm-up to the full rate over `warmup_steps`, then `decay(progress)` with progress 0 -> 1 at the end."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(total_steps - warmup_steps, 1)
        return decay(min(1.0, (step - warmup_steps) / span))
    return factor


def warmup_cosine(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0,
                  min_lr_ratio: float = 0.0) -> LambdaLR:
    """Warm up linearly, then follow a half cosine down to `min_lr_ratio` x the initial rate at the last step."""
    _check(total_steps, warmup_steps, min_lr_ratio, "min_lr_ratio")
    return LambdaLR(optimizer, _warmup_then(
        total_steps, warmup_steps, lambda p: min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))))


def cosine(optimizer: Optimizer, total_steps: int, min_lr_ratio: float = 0.0) -> LambdaLR:
    """A half cosine from the initial rate down to `min_lr_ratio` x it at the last step."""
    return warmup_cosine(optimizer, total_steps, 0, min_lr_ratio)


def linear(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, end_lr_ratio: float = 0.0) -> LambdaLR:
    """Warm up linearly, then decay linearly to `end_lr_ratio` x the initial rate at the last step."""
    _check(total_steps, warmup_steps, end_lr_ratio, "end_lr_ratio")
    return LambdaLR(optimizer, _warmup_then(total_steps, warmup_steps, lambda p: 1 - (1 - end_lr_ratio) * p))


# -- the rates a schedule gives: checked before any worker starts --------------------------------------

# A schedule may rise to this multiple of the optimizer's rate (warm-up peaks, cycles); beyond, it diverges.
MAX_RISE = 10.0


def learning_rates(scheduler: Any, steps: int) -> list[float]:
    """The rate each of the first `steps` optimizer steps trains with (the first group's), stepping `scheduler`.

    The scheduler's optimizer never steps: only the schedule's arithmetic runs, microseconds a step.
    """
    group = scheduler.optimizer.param_groups[0]
    rates = [float(group["lr"])]
    for _ in range(steps - 1):
        scheduler.step()
        rates.append(float(group["lr"]))
    return rates


def schedule_problem(rates: Sequence[float], planned: int, reference: float) -> Optional[str]:
    """What is wrong with `rates`, the first of the run's `planned` steps' learning rates, or None.

    Negative or non-finite rates climb the loss; more than MAX_RISE x `reference` (the configured rate) diverges;
    0 from a step before the last to the end trains nothing from there (0 at the last step alone is a decay's
    end). When `rates` covers a prefix of the run only, a zero tail is not judged unless the whole prefix is 0.
    """
    bad = next((i for i, lr in enumerate(rates) if not (math.isfinite(lr) and lr >= 0)), None)
    high = next((i for i, lr in enumerate(rates) if lr > MAX_RISE * reference * (1 + 1e-9)), None)  # rounding
    if high is not None and (bad is None or high < bad):  # the first that goes wrong
        return (f"the learning rate rises to {rates[high]:.3g} at step {high + 1} of the run's {planned}, over "
                f"{MAX_RISE:g}x the configured {reference:g}: a schedule may rise to {MAX_RISE:g}x at most (set a "
                "higher optimizer.lr for a higher peak)")
    if bad is not None:
        return (f"the learning rate is {rates[bad]:.3g} at step {bad + 1} of the run's {planned}: it must stay "
                "positive and finite (a negative rate climbs the loss)")
    zero_from = len(rates)
    while zero_from > 0 and rates[zero_from - 1] == 0:
        zero_from -= 1
    if zero_from == 0:
        span = (f"the whole run ({planned} optimizer steps)" if len(rates) == planned
                else f"the first {len(rates)} steps of the run's {planned}")
        return f"the learning rate is 0 for {span}: nothing trains"
    if len(rates) == planned and zero_from < planned - 1:
        return (f"the learning rate is 0 from step {zero_from + 1} to the run's last step {planned}: "
                f"{planned - zero_from} of its {planned} optimizer steps train nothing")
    return None


# -- what a checkpoint records of its schedule: the scheduler, its settings, and the steps it was planned over ----

def configured(flat: Mapping[str, Any]) -> dict:
    """The scheduler's settings from the flattened resolved config (its `scheduler.<key>` keys, as the loop's
    hparams hold them): `_target_` and what it is called with."""
    prefix = "scheduler."
    return {key[len(prefix):]: value for key, value in sorted(flat.items())
            if key.startswith(prefix) and key != "scheduler._partial_"}


def takes_total_steps(settings: Mapping[str, Any]) -> bool:
    """The runner passes the run's step count to this scheduler (it takes `total_steps`, its config leaves it out)."""
    from hydra.utils import get_method

    if not settings.get("_target_"):  # no scheduler group (a LightningModule's configure_optimizers() schedules)
        return False
    try:
        takes = "total_steps" in inspect.signature(get_method(str(settings.get("_target_")))).parameters
    except Exception:  # noqa: BLE001 - a target that does not import is reported by the config checks
        return False
    return takes and "total_steps" not in settings


def plan(settings: Mapping[str, Any], start: int, steps: int) -> dict:
    """The checkpoint's record: `settings`, the step the schedule started at, and the optimizer steps it is
    planned over from there (the configured total_steps, the run's `steps`, or None: not planned over steps)."""
    total = settings.get("total_steps", steps if takes_total_steps(settings) else None)
    return {"scheduler": dict(settings), "start": start, "total_steps": total}


def described(settings: Mapping[str, Any]) -> str:
    """`cosine (min_lr_ratio=0.0)`: the target's last name and its settings."""
    name = str(settings.get("_target_", "an unknown scheduler")).rpartition(".")[2]
    shown = ", ".join(f"{key}={value}" for key, value in settings.items() if key != "_target_")
    return f"{name} ({shown})" if shown else name


def schedule_change(saved: Mapping[str, Any], mine: Mapping[str, Any], path: Any, step: Any) -> Optional[str]:
    """One line refusing an exact resume whose configured scheduler or settings are not the checkpoint's, or None."""
    if dict(saved) == dict(mine):
        return None
    return (f"trainer.ckpt_path={path} was trained with scheduler {described(saved)}, this run configures "
            f"{described(mine)}; resume with the scheduler it was trained with, or set trainer.resume=new_schedule "
            f"to start this one at step {step} over the remaining steps")


def unreachable(checkpoint: Mapping[str, Any], end: int, path: Any) -> Optional[str]:
    """One line when a scheduler the checkpoint holds was planned over fewer steps than an exact resume takes it
    from the checkpoint's step to step `end` (OneCycleLR fails at the first step past its plan), or None.

    Read from the checkpoint's data alone: each scheduler state with `total_steps` and `last_epoch`, stepped at each
    optimizer step (the scheduler group's), or every `frequency` steps (a LightningModule's with interval 'step';
    its epoch-interval and manually stepped ones are not judged)."""
    step, state = checkpoint.get("step"), checkpoint.get("scheduler")
    if not isinstance(state, Mapping) or not isinstance(step, int):
        return None
    if isinstance(state.get("schedulers"), list):  # runner.lightning's record: the schedulers of configure_optimizers()
        counted, kinds = int(state.get("steps", 0)), state.get("configs") or [{}] * len(state["schedulers"])
        entries = [(saved, kind.get("class", "scheduler"), kind.get("interval", "step"), int(kind.get("frequency", 1)))
                   for saved, kind in zip(state["schedulers"], kinds)]
    else:
        counted, target = step, str((checkpoint.get("schedule") or {}).get("scheduler", {}).get("_target_", ""))
        entries = [(state, target.rpartition(".")[2] or "scheduler", "step", 1)]
    for saved, name, interval, frequency in entries:
        total, taken = saved.get("total_steps"), saved.get("last_epoch")
        if interval != "step" or not (isinstance(total, int) and isinstance(taken, int)):
            continue
        left = total - taken
        if (counted + end - step) // frequency - counted // frequency <= left:
            continue
        fails = step + (counted // frequency + left + 1) * frequency - counted  # the optimizer step of its last call
        return (f"trainer.ckpt_path={path}: its {name} was planned over {total} steps and has {left} left at step "
                f"{step}, but this run goes on to step {end}, and it would fail at step {fails}; set "
                f"trainer.resume=new_schedule to make the schedule afresh at step {step} over the {end - step} steps "
                f"left, or trainer.max_steps={fails - 1}")
    return None
