"""Several named optimizers (`optimizer.<name>._params_`): each parameter of the model, built on the meta device, in
exactly one of them, each `_params_` and `_no_decay_` entry taking a parameter, and a strategy that can run them."""

from __future__ import annotations

from typing import Iterator

import torch
from omegaconf import DictConfig

from runner.build import NO_DECAY, no_decay_matches
from runner.checks.signatures import is_fsdp
from runner.plan import Plan
from runner.values import named_optimizers


def check_optimizer_parts(plan: Plan) -> Iterator[str]:
    cfg = plan.cfg
    parts = named_optimizers(cfg.get("optimizer"))
    if parts is None or cfg.get("stage", "fit") != "fit":
        return
    from runner.loop.optimizers import assign_parts  # the loop package: imported where several optimizers are named

    if is_fsdp(cfg) and _losses_per_optimizer(cfg):
        yield (f"task ({cfg.task._target_}) gives one loss per optimizer, which strategy=fsdp does not run (its "
               "gradients are reduced in each backward pass); use strategy=ddp")
        return
    model = plan.meta_model
    if not isinstance(model, torch.nn.Module):
        return
    taken, problems = assign_parts(model, parts)
    yield from problems
    for name, node in parts.items():
        entries = [str(e) for e in node.get(NO_DECAY) or ()]
        mine = set(taken.get(name, ()))
        for entry, found in no_decay_matches(model, entries).items():
            if not mine.intersection(found):
                yield (f"optimizer.{name}.{NO_DECAY}: {entry} matches none of the parameters optimizer.{name} trains "
                       f"({', '.join(sorted(mine)[:4]) or 'none'})")


def _losses_per_optimizer(cfg: DictConfig) -> bool:
    from hydra.utils import get_method

    try:
        return bool(getattr(get_method(str(cfg.task._target_)), "losses_per_optimizer", False))
    except Exception:  # noqa: BLE001 - a target that does not import is reported by the static checks
        return False
