"""Several optimizers, each over a part of the model: which parameters each takes (`optimizer.<name>._params_`), and
the one optimizer the loop, its scheduler, its checkpoint and its logs see (their parameter groups in order, one
state_dict holding each optimizer's, zero_grad and step over all of them)."""

from __future__ import annotations

import fnmatch
from typing import Any, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

# The runner's key in a named optimizer's settings (as `_no_decay_`), which its constructor never sees.
PARAMS = "_params_"


class OptimizerSet(torch.optim.Optimizer):
    """The optimizers a model's parts train with (named in the config, or a LightningModule's list), in their order.

    `param_groups` is every optimizer's groups in order (the same dicts: a learning rate set there is the optimizer's),
    so one scheduler shapes each group's rate from its own, and the lr log, a resume's settings and a loss scaler's
    unscale see each group once. `state_dict()` keeps each optimizer's own state dict under "optimizers", and the
    groups under "param_groups" as one optimizer's would be, so a checkpoint of another optimizer (or another count of
    them) is refused by the same checks. An Optimizer for torch's schedulers, which take nothing else; its own
    constructor is not called: the optimizers it holds own the parameters.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], names: Optional[list[str]] = None) -> None:
        self.optimizers = list(optimizers)
        self.names = list(names) if names is not None else [str(i) for i in range(len(self.optimizers))]
        self.defaults: dict = dict(self.optimizers[0].defaults) if self.optimizers else {}  # the first group's

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        return {key: value for optimizer in self.optimizers for key, value in optimizer.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Any] = None) -> None:  # type: ignore[override]
        for optimizer in self.optimizers:
            optimizer.step()

    def register_step_post_hook(self, hook: Any) -> Any:
        """The hook after each of its optimizers' steps: those a module steps itself (manual optimization) too."""
        handles = [optimizer.register_step_post_hook(hook) for optimizer in self.optimizers]
        return _Handles(handles)

    def register_step_pre_hook(self, hook: Any) -> Any:
        return _Handles([optimizer.register_step_pre_hook(hook) for optimizer in self.optimizers])

    def state_dict(self) -> dict:
        states = [optimizer.state_dict() for optimizer in self.optimizers]
        return {"state": {}, "param_groups": [group for state in states for group in state["param_groups"]],
                "optimizers": states, "classes": [type(optimizer).__name__ for optimizer in self.optimizers],
                "names": list(self.names)}

    def load_state_dict(self, state: dict) -> None:  # type: ignore[override]
        from runner.config import ConfigError

        saved = state.get("optimizers")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            count = len(saved) if isinstance(saved, list) else 1
            raise ConfigError([f"trainer.ckpt_path: the checkpoint holds {count} optimizer(s), this run has "
                               f"{len(self.optimizers)} ({self}); resume with the optimizers it was trained with"])
        for optimizer, optimizer_state in zip(self.optimizers, saved):
            optimizer.load_state_dict(optimizer_state)

    def __repr__(self) -> str:
        return "OptimizerSet(" + ", ".join(f"{name}={type(optimizer).__name__}"
                                           for name, optimizer in zip(self.names, self.optimizers)) + ")"


class _Handles:
    """One handle for a hook registered on each optimizer of a set."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def optimizers_of(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The optimizers behind the loop's optimizer: a set's, or the one."""
    return list(optimizer.optimizers) if isinstance(optimizer, OptimizerSet) else [optimizer]


def average_gradients(strategy: Any, optimizer: Any) -> None:
    """The mean over processes of the gradients of `optimizer`'s parameters, one all-reduce per dtype (every process
    holds gradients for the same parameters: the same step ran on each). For steps that back-propagate more than once
    through one forward graph, where DDP's own hooks (one reduction per parameter per forward) cannot sync."""
    if strategy.world_size == 1:
        return
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    for dtype in dict.fromkeys(g.dtype for g in grads):
        same = [g for g in grads if g.dtype == dtype]
        mean = strategy.all_reduce(_flatten_dense_tensors(same), reduce_op="mean")
        torch._foreach_copy_(same, list(_unflatten_dense_tensors(mean, same)))


def _matches(entry: str, name: str) -> bool:
    """A submodule's name takes its parameters (`net.0`: net.0.weight, net.0.bias); any other entry is a pattern
    of parameter names (`*.bias`, `encoder.*`)."""
    return name == entry or name.startswith(entry + ".") or fnmatch.fnmatchcase(name, entry)


def assign_parts(model: torch.nn.Module, parts: dict[str, Any]) -> tuple[dict[str, list[str]], list[str]]:
    """({optimizer name: the names of the trainable parameters its `_params_` takes}, problems): every trainable
    parameter must be in exactly one part, and every entry must take one."""
    names = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    taken: dict[str, list[str]] = {}
    problems = []
    for part, settings in parts.items():
        entries = settings.get(PARAMS)
        entries = [entries] if isinstance(entries, str) else list(entries or [])
        if not entries or not all(isinstance(e, str) and e for e in entries):
            problems.append(f"optimizer.{part}.{PARAMS}={settings.get(PARAMS)} must name the parameters it trains: a "
                            "list of submodule names or patterns, e.g. [encoder] or ['*.bias']")
            continue
        for entry in entries:
            if not any(_matches(entry, name) for name in names):
                problems.append(f"optimizer.{part}.{PARAMS}: {entry} matches no trainable parameter of the model; its "
                                f"parameters are named like {', '.join(names[:6])}")
        taken[part] = [name for name in names if any(_matches(e, name) for e in entries)]
    owners: dict[str, list[str]] = {}
    for part, found in taken.items():
        for name in found:
            owners.setdefault(name, []).append(part)
    twice = [f"{name} ({' and '.join(parts_)})" for name, parts_ in owners.items() if len(parts_) > 1]
    missing = [name for name in names if name not in owners]
    if twice:
        problems.append(f"optimizer: {len(twice)} parameter(s) are in more than one optimizer's {PARAMS}: "
                        f"{', '.join(twice[:4])}; each trainable parameter goes to one optimizer")
    if missing and not problems:
        problems.append(f"optimizer: {len(missing)} trainable parameter(s) are in no optimizer's {PARAMS}: "
                        f"{', '.join(missing[:6])}; name them (or a submodule holding them) in one")
    return taken, problems
