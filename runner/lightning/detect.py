"""Whether an object or class is one of Lightning's, told by its classes' names and modules: lightning is never
imported to tell (a user's module that is a LightningModule has imported it already)."""

from __future__ import annotations

import inspect
from typing import Any, Optional

# Where Lightning's classes live: the unified package and the standalone one.
PACKAGES = ("lightning.pytorch", "pytorch_lightning", "lightning_fabric", "lightning.fabric")


def is_lightning_code(cls: type) -> bool:
    """Whether `cls` is defined inside Lightning itself (not a user's subclass)."""
    module = getattr(cls, "__module__", "") or ""
    return any(module == package or module.startswith(package + ".") for package in PACKAGES)


def _classes(obj: Any) -> tuple:
    cls = obj if inspect.isclass(obj) else type(obj)
    return getattr(cls, "__mro__", ())


def _derives(obj: Any, name: str) -> bool:
    return any(c.__name__ == name and is_lightning_code(c) for c in _classes(obj))


def is_lightning_module(obj: Any) -> bool:
    """A LightningModule (instance or class), lightning.pytorch's or pytorch_lightning's."""
    return _derives(obj, "LightningModule")


def is_lightning_datamodule(obj: Any) -> bool:
    return _derives(obj, "LightningDataModule")


def is_lightning_callback(obj: Any) -> bool:
    return _derives(obj, "Callback")


def overrides(obj: Any, name: str) -> bool:
    """Whether `obj`'s class (or a base of the user's) defines `name`, rather than Lightning's own classes."""
    for cls in _classes(obj):
        if name in vars(cls):
            return not is_lightning_code(cls) and cls is not object
    return False


def stock_base(obj: Any, below: str) -> Optional[type]:
    """The first of Lightning's own classes in `obj`'s classes other than its `below` base (Callback, ...) and what
    that derives from: a stock Lightning callback such as ModelCheckpoint, or the one a user's class extends."""
    for cls in _classes(obj):
        if is_lightning_code(cls):
            return None if cls.__name__ == below else cls
    return None


def model_class(target: str) -> Optional[type]:
    """The class `model._target_` names when it is a LightningModule (importing the user's module), else None."""
    from hydra.utils import get_method

    try:
        found = get_method(target)
    except Exception:  # noqa: BLE001 - the static checks report a target that does not import
        return None
    return found if inspect.isclass(found) and is_lightning_module(found) else None


def is_lightning_config(cfg: Any) -> bool:
    """Whether the config's model is a LightningModule class."""
    model = cfg.get("model") if hasattr(cfg, "get") else None
    target = model.get("_target_") if model is not None and hasattr(model, "get") else None
    return isinstance(target, str) and model_class(target) is not None
