"""How the checks and the builders read config values and word what is wrong with them (imports no runner module)."""

from __future__ import annotations

import difflib
from typing import Any

from hydra.errors import InstantiationException
from omegaconf import OmegaConf


def is_int(value: Any) -> bool:
    """An integer setting: YAML's `true` is a bool, which Python also counts as an int."""
    return isinstance(value, int) and not isinstance(value, bool)


def show(value: Any) -> Any:
    """A config node as the plain list or dict a message prints; any other value as it is."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def suggest(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def one_line(error: BaseException) -> str:
    """`Type: message` on one line; for a failed instantiate, of what the target itself raised."""
    if isinstance(error, InstantiationException) and error.__cause__ is not None:
        error = error.__cause__
    return " ".join(f"{type(error).__name__}: {error}".split())
