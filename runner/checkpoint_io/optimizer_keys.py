"""Optimizer state keyed by parameter name instead of index, for checkpoints any process count or grouping reads.

An optimizer's `state_dict()` numbers its parameters in the order of its groups (torch's packing): with
`optimizer._no_decay_`'s two groups, or several optimizers each over part of a model, index i is not the model's
i-th parameter. A sharded checkpoint stores each tensor under the name of the parameter it belongs to, so each
process can read just its slice of it; these functions translate both ways. Every function takes the list of a
checkpoint's optimizer state dicts (`states_of`): one optimizer is the list of one.
"""

from __future__ import annotations

from typing import Iterable

import torch

from runner.checkpoint_io.base import CheckpointError

# What activation checkpointing's wrapper inserts into parameter names; the model's state_dict() leaves it out.
_WRAPPER = "_checkpoint_wrapped_module."
# An optimizer state dict's own record of its parameters' names, in index order (`record_names`). A key beside
# `state` and `param_groups`, which torch's load_state_dict leaves alone and no group setting shows: a run's
# groups compare equal with a checkpoint of the same groups written before the record.
NAMES_KEY = "parameter_names"


def clean(name: str) -> str:
    """A parameter's name as the model's state_dict() spells it."""
    return name.replace(_WRAPPER, "")


def states_of(optimizer_state: dict) -> list[dict]:
    """The optimizer state dicts in a checkpoint's `optimizer` entry: a set's `optimizers`, or the one."""
    several = optimizer_state.get("optimizers")
    return list(several) if isinstance(several, list) else [optimizer_state]


def with_states(optimizer_state: dict, states: list[dict]) -> dict:
    """`optimizer_state` with its optimizer state dicts replaced by `states` (the order of `states_of`)."""
    if isinstance(optimizer_state.get("optimizers"), list):
        return {**optimizer_state, "optimizers": states}
    (state,) = states
    return state


def record_names(optimizers: Iterable[torch.optim.Optimizer], model: torch.nn.Module) -> None:
    """Make each optimizer's state_dict() carry its parameters' names in index order (under NAMES_KEY): what lets a
    sharded checkpoint key its state by name. The names are read at each call, so groups added later count."""
    names = {id(p): clean(n) for n, p in model.named_parameters()}

    def add_names(optimizer: torch.optim.Optimizer, state: dict) -> None:
        found = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
        if all(isinstance(name, str) for name in found):  # a parameter from outside the model: nothing to say
            state[NAMES_KEY] = found

    for optimizer in optimizers:
        optimizer.register_state_dict_post_hook(add_names)


def index_names(states: list[dict], model_names: list[str]) -> list[list[str]]:
    """Each state dict's parameter names in the order its groups list them (the order torch numbers them in): from
    its NAMES_KEY (`record_names`: the runner's build records it for grouped optimizers) or its groups'
    `param_names` (an optimizer built over named parameters); an unnamed single optimizer over the whole model is
    in the model's order. Anything else cannot be told apart."""
    result = []
    for state in states:
        groups = state.get("param_groups", [])
        count = sum(len(group["params"]) for group in groups)
        if isinstance(state.get(NAMES_KEY), list):
            names = [clean(str(name)) for name in state[NAMES_KEY]]
        elif groups and all(isinstance(group.get("param_names"), list) for group in groups):
            names = [clean(name) for group in groups for name in group["param_names"]]
        elif len(states) == 1 and len(groups) == 1 and count == len(model_names):
            names = list(model_names)
        else:
            raise CheckpointError(
                f"cannot tell which parameter each optimizer state belongs to: {len(states)} optimizer(s), "
                f"{len(groups)} group(s) over {count} of the model's {len(model_names)} parameters, and no names "
                f"of them ({NAMES_KEY}: record_names)")
        if len(names) != count:
            raise CheckpointError(f"an optimizer's state dict names {len(names)} parameters, its groups hold {count}")
        result.append(names)
    return result


def by_name(state: dict, names: list[str]) -> dict:
    """One optimizer state dict with its per-parameter state and its groups' `params` keyed by name."""
    position = [index for group in state["param_groups"] for index in group["params"]]
    name_of = dict(zip(position, names))
    groups = [{**group, "params": [name_of[index] for index in group["params"]]} for group in state["param_groups"]]
    return {**state, "state": {name_of[int(index)]: entries for index, entries in state.get("state", {}).items()},
            "param_groups": groups}


def by_index(state: dict) -> dict:
    """What `by_name` took apart: indices numbered in the groups' order, as torch's state_dict() numbers them."""
    index_of: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        params = [index_of.setdefault(name, len(index_of)) if isinstance(name, str) else name
                  for name in group["params"]]
        groups.append({**group, "params": params})
    missing = sorted(str(key) for key in state.get("state", {}) if isinstance(key, str) and key not in index_of)
    if missing:
        raise CheckpointError(f"the optimizer state names parameters its groups do not hold: {', '.join(missing[:3])}")
    entries = {index_of.get(key, key) if isinstance(key, str) else int(key): value
               for key, value in state.get("state", {}).items()}
    return {**state, "state": dict(sorted(entries.items())), "param_groups": groups}


def is_named(state: dict) -> bool:
    """Whether a stored optimizer state dict's groups list parameter names (the sharded layout since names)."""
    return any(isinstance(p, str) for group in state.get("param_groups", []) for p in group.get("params", []))
