"""What a checkpoint may hold: what `torch.load(..., weights_only=True)` reads back (tensors, numbers, strings and
the plain containers of them), so that no checkpoint is ever written that its own run could not load."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

import torch

_LEAVES = (bool, int, float, complex, str, bytes, type(None), torch.Size, torch.dtype, torch.device)
_MAPPINGS = (dict, OrderedDict)  # exactly these: a weights-only load refuses their subclasses (defaultdict)
_SEQUENCES = (list, tuple, set)


def unloadable(value: Any, path: str = "") -> Optional[str]:
    """`path: type` of the first value in `value` a weights-only load would refuse, or None when all of it loads."""
    kind = type(value)
    if kind in _LEAVES or isinstance(value, torch.Tensor):
        return None
    if kind in _MAPPINGS:
        for key, item in value.items():
            if type(key) not in _LEAVES:
                return f"{path or 'a key'}: a key of type {type(key).__name__}"
            found = unloadable(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
        return None
    if kind in _SEQUENCES:
        for index, item in enumerate(value):
            found = unloadable(item, f"{path}[{index}]")
            if found:
                return found
        return None
    return f"{path or 'the value'}: {kind.__module__}.{kind.__qualname__}"
