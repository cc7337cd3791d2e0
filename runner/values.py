"""How the checks and the builders read config values and word what is wrong with them (imports no runner module)."""

from __future__ import annotations

import difflib
from typing import Any, Optional

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


def named_optimizers(node: Any) -> Optional[dict[str, Any]]:
    """`optimizer` as {name: its settings} when it names several optimizers (no `_target_` of its own, every entry
    one with `_target_`); None when it is one optimizer."""
    if not OmegaConf.is_dict(node) or "_target_" in node or len(node) == 0:
        return None
    entries = {str(name): value for name, value in node.items()}
    return entries if all(OmegaConf.is_dict(v) and "_target_" in v for v in entries.values()) else None


def optimizer_nodes(node: Any) -> dict[str, Any]:
    """{the key a message names: the settings} of each optimizer the `optimizer` group configures."""
    parts = named_optimizers(node)
    return {"optimizer": node} if parts is None else {f"optimizer.{name}": value for name, value in parts.items()}
