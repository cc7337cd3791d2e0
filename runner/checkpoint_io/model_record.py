"""What an export needs to know about a run's model, written as plain JSON (`model.json`) when the run starts.

`python -m runner.export` never imports the module a run's config names, so what only the built model knows is
recorded while the run has it: its class's name, whether it is a transformers `PreTrainedModel` (with its config, the
`config.json` HuggingFace's `from_pretrained` reads) or a Lightning `LightningModule` (with the plain part of what
its `save_hyperparameters()` recorded). Classes are told by their names and modules; nothing is imported to tell.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Literal, Optional

from runner.checkpoint_io.base import CheckpointError
from runner.checkpoint_io.safetensors_io import write_atomic

FILE = "model.json"
Kind = Literal["transformers", "lightning", "torch"]


def kind_of(model: Any, lightning: bool = False) -> Kind:
    """transformers for a PreTrainedModel, lightning for a LightningModule (the caller tells: this package never asks
    the Lightning adapter), else torch."""
    if lightning:
        return "lightning"
    for cls in type(model).__mro__:
        if cls.__name__ == "PreTrainedModel" and (cls.__module__ or "").startswith("transformers."):
            return "transformers"
    return "torch"


def describe(model: Any, lightning: bool = False) -> dict:
    """The record of `model`: `class`, `kind`, and `hf_config` or `hyper_parameters` by its kind (`lightning`: it
    is a LightningModule)."""
    cls = type(model)
    record: dict = {"class": f"{cls.__module__}.{cls.__qualname__}", "kind": kind_of(model, lightning)}
    if record["kind"] == "transformers":
        # The config's own JSON form (what save_pretrained writes), with the class save_pretrained names.
        config = json.loads(model.config.to_json_string(use_diff=False))
        config["architectures"] = [cls.__name__]
        record["hf_config"] = config
    elif record["kind"] == "lightning":
        hparams = {k: plain_form(v) for k, v in dict(getattr(model, "hparams", {}) or {}).items()}
        kept, _ = plain_hyper_parameters(hparams)
        record["hyper_parameters"] = kept
        record["objects"] = sorted(k for k, v in hparams.items() if not is_plain(v) and not names_code(k, v))
    return record


def record_model(model: Any, run_dir: str | os.PathLike, lightning: bool = False) -> bool:
    """Write `<run_dir>/model.json` (global rank 0, once the model is built, before training); False when it could
    not. It never fails the run: without the record only the hf and lightning exports are missing, and a warning
    says why."""
    try:
        text = json.dumps(describe(model, lightning), indent=2, sort_keys=True) + "\n"
        write_atomic(os.fspath(Path(run_dir) / FILE), [text.encode()])
    except Exception as err:  # noqa: BLE001 - a model or config this cannot describe must not stop training
        logging.getLogger("runner").warning("%s not written (runner.export --format hf/lightning will lack it): %s",
                                            FILE, " ".join(str(err).split()) or type(err).__name__)
        return False
    return True


def read_record(run_dir: Optional[Path]) -> Optional[dict]:
    """The run's model.json, or None where the run wrote none."""
    path = run_dir / FILE if run_dir is not None else None
    if path is None or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}; it is written by the run as JSON") from err
    if not isinstance(record, dict):
        raise CheckpointError(f"cannot read {path}: it holds a {type(record).__name__}, not the run's model record")
    return record


def plain_form(value: Any) -> Any:
    """An OmegaConf node (what Hydra passes for a nested mapping) as plain dicts and lists; anything else as is."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


# Keys that name code for a loader to import and call: Hydra's (`_target_`, `_partial_`, ...), Lightning's
# `_instantiator` (load_from_checkpoint calls it), jsonargparse's `class_path` (LightningCLI's configs).
_CODE_KEYS = ("_target_", "_instantiator", "class_path")


def names_code(key: str, value: Any) -> bool:
    """Whether hyperparameter `key` (or anything in its value) names code to call: a key of Hydra's `_name_` form or
    Lightning's private `_...` ones, or a mapping holding one of _CODE_KEYS. Such a value is never exported."""
    if str(key).startswith("_"):
        return True
    if isinstance(value, dict):
        return any(k in _CODE_KEYS or names_code(k, v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(names_code("", v) for v in value)
    return False


def plain_hyper_parameters(hparams: dict) -> tuple[dict, list[str]]:
    """(the hyperparameters that are plain data naming no code, the keys left out because they name code)."""
    kept = {k: v for k, v in hparams.items() if is_plain(v) and not names_code(k, v)}
    return kept, sorted(k for k, v in hparams.items() if names_code(k, v))


def is_plain(value: Any) -> bool:
    """Numbers, strings, None and lists or string-keyed dicts of them: what JSON and a weights-only load hold."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return False
