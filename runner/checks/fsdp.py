"""strategy=fsdp's own settings, and the module classes they name against the model.

CLI → compose → [validate: this check, after the callbacks and loggers] → run folder → launch → worker → build →
loop → teardown. The model is built on the meta device (shapes only) to list its classes.
"""

from __future__ import annotations

from typing import Iterator

from omegaconf import OmegaConf

from runner.checks.signatures import is_fsdp
from runner.plan import Plan


def check_fsdp(plan: Plan) -> Iterator[str]:
    """strategy=fsdp's settings, and the class names it names against the model (built on the meta device)."""
    from runner.strategies import fsdp

    cfg = plan.cfg
    if not is_fsdp(cfg):
        return
    node = cfg.strategy
    shard = node.get("shard", "auto")
    shard = shard if shard == "auto" else fsdp.as_names(shard)
    checkpointing = fsdp.as_names(node.get("activation_checkpointing") or [])
    precision = OmegaConf.create({"precision": cfg.precision.get("precision")})
    problems = fsdp.settings_problems(shard, checkpointing, node.get("state_dict_type", "sharded"), precision)
    yield from problems
    if problems:
        return
    model = plan.meta_model
    if model is None:
        return
    for key, names in (("shard", [] if shard == "auto" else shard), ("activation_checkpointing", checkpointing)):
        missing = sorted(set(names) - set(fsdp.module_classes(model)))
        if missing:
            yield fsdp.unknown_classes_message(key, missing, model)
