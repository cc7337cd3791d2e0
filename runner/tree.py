"""Apply a function to every tensor of a nested batch or collection, keeping every container's type."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


def apply_to_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`fn` on each tensor in nested dicts, lists, tuples, namedtuples and dataclasses; other leaves pass through."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        # A shallow copy keeps dict subclasses (OrderedDict, defaultdict) with their own settings.
        out = data.copy()
        for key, value in data.items():
            out[key] = apply_to_tensors(value, fn)
        return out
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(apply_to_tensors(v, fn) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(apply_to_tensors(v, fn) for v in data)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        # replace() re-runs __init__, so only fields it takes are passed; the others are copied over after.
        changed = {f.name: apply_to_tensors(getattr(data, f.name), fn) for f in dataclasses.fields(data)}
        out = dataclasses.replace(data, **{f.name: changed[f.name] for f in dataclasses.fields(data) if f.init})
        for f in dataclasses.fields(data):
            if not f.init:
                object.__setattr__(out, f.name, changed[f.name])
        return out
    return data
