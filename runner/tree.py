"""Apply a function to every tensor of a nested batch or collection, keeping every container's type."""

from __future__ import annotations

from typing import Any, Callable

import torch


def apply_to_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`fn` on each tensor in nested dicts, lists, tuples and namedtuples; other leaves pass through."""
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
    return data
