"""A runner checkpoint's weights in the formats other tools read: a HuggingFace `save_pretrained` folder and a
Lightning checkpoint for `LightningModule.load_from_checkpoint`. Everything comes from files as data: the run's
`model.json` (model_record), its `.hydra/resolved.yaml` and the checkpoint; no module they name is imported.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path
from typing import Optional

import torch

from runner.checkpoint_io import safetensors_io
from runner.checkpoint_io.base import CheckpointError
from runner.checkpoint_io.model_record import FILE as RECORD_FILE
from runner.checkpoint_io.model_record import is_plain, names_code, plain_hyper_parameters, read_record

HF_WEIGHTS, HF_CONFIG = "model.safetensors", "config.json"  # the names from_pretrained looks for first
LIGHTNING_TASK = "runner.lightning.task.LightningTask"  # a checkpoint's `task` when its model was a LightningModule
_RECORD_ADVICE = ("a run records it in model.json when it starts, or the run's config gives it as data: model.config "
                  "with a model_type (model.config._target_: transformers.GPT2Config, model.config.model_type: gpt2)")


def foreign_format(path: str | os.PathLike) -> Optional[str]:
    """What `path` is when it is weights in another tool's format, not a runner checkpoint: a safetensors file (its
    8-byte header length, then JSON) or a HuggingFace save_pretrained folder (config.json beside the weights); None
    for anything else. Read as bytes: nothing is loaded."""
    path = Path(path)
    if path.is_dir():
        weights = [p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin")]
        return "a HuggingFace save_pretrained folder" if (path / HF_CONFIG).is_file() and weights else None
    try:
        with open(path, "rb") as file:
            head = file.read(9)
            size = os.fstat(file.fileno()).st_size
    except OSError:
        return None
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8:
        return "a safetensors file"
    return None


WEIGHTS_ALONE = ("weights alone (as runner.export and save_pretrained write them), which no run resumes or evaluates "
                 "from: name a runner checkpoint (a run's checkpoints/*.ckpt), or load these weights in the model's "
                 "own constructor")


_NOT_THIS_RUN = ("the record does not describe this checkpoint (another run's, or edited); export as torch or "
                 "safetensors, or put back the run's own model.json")


class RunFacts:
    """What the run folder says about the model: its model.json and the `model` node of its resolved config."""

    def __init__(self, run_dir: Optional[Path], checkpoint: dict) -> None:
        self.run_dir = run_dir
        self.record = read_record(run_dir) or {}
        self.model_cfg = _model_config(run_dir)
        self.task = checkpoint.get("task")
        self._check_record()

    def _check_record(self) -> None:
        """model.json's kind against the checkpoint's task, which the run wrote checksummed: a LightningModule trains
        under the Lightning task and nothing else does. A record that says otherwise describes another run."""
        kind = self.record.get("kind")
        if not self.record or self.task is None:
            return
        if kind not in ("transformers", "lightning", "torch") or (kind == "lightning") != (self.task == LIGHTNING_TASK):
            raise CheckpointError(f"{self.run_dir / RECORD_FILE} says the model is {self.record.get('class')} (kind "
                                  f"{kind}), but the checkpoint was trained with task {self.task}: {_NOT_THIS_RUN}")

    @property
    def target(self) -> str:
        """model._target_ as written (a name only, never imported)."""
        target = self.model_cfg.get("_target_")
        return target if isinstance(target, str) else "(unknown)"

    def describe(self) -> str:
        if self.record:
            return f"{self.record.get('class')} (a {self.record.get('kind')} model)"
        if self.task == LIGHTNING_TASK:
            return f"a LightningModule (model._target_={self.target})"
        return f"model._target_={self.target} (task {self.task})"

    def is_lightning(self) -> bool:
        if self.record:
            return self.record.get("kind") == "lightning"
        return self.task == LIGHTNING_TASK


def run_dir_of(source: Path, checkpoint_path: Path) -> Optional[Path]:
    """The run folder: `source` when it is one, or the folder holding checkpoints/<the checkpoint>."""
    for folder in (source, checkpoint_path.parent.parent if checkpoint_path.parent.name == "checkpoints" else None):
        if folder is not None and folder.is_dir() and (folder / ".hydra").is_dir():
            return folder
    return None


def _model_config(run_dir: Optional[Path]) -> dict:
    """The resolved `model` node as plain data ({} without a run folder). OmegaConf's loader is YAML's safe one."""
    path = run_dir / ".hydra" / "resolved.yaml" if run_dir is not None else None
    if path is None or not path.is_file():
        return {}
    from omegaconf import OmegaConf

    try:
        node = OmegaConf.load(path).get("model")
        model = OmegaConf.to_container(node, resolve=False) if node is not None else {}
    except Exception as err:  # noqa: BLE001 - any parse failure is the file's, said in one line
        raise CheckpointError(f"cannot read {path}: {' '.join(str(err).split())}") from err
    return model if isinstance(model, dict) else {}


# -- HuggingFace -----------------------------------------------------------------------------------------------------
def hf_config(facts: RunFacts, weights: dict[str, torch.Tensor]) -> dict:
    """config.json's contents: the recorded PreTrainedModel config, or model.config with a model_type."""
    if facts.record.get("kind", "transformers") != "transformers" or facts.is_lightning():
        raise CheckpointError(f"--format hf needs a transformers PreTrainedModel; this run's model is "
                              f"{facts.describe()}: {_other_formats(facts)}")
    config = facts.record.get("hf_config")
    if config is None:
        given = facts.model_cfg.get("config")
        if not (isinstance(given, dict) and isinstance(given.get("model_type"), str)):
            raise CheckpointError(f"--format hf needs the run's HuggingFace config and this run ({facts.describe()}) "
                                  f"recorded none: {_RECORD_ADVICE}; {_other_formats(facts)}")
        config = {k: v for k, v in given.items() if not k.startswith("_")}
    config = dict(config)
    _check_fits(facts, config, weights)
    dtypes = {t.dtype for t in weights.values() if t.is_floating_point()}
    if len(dtypes) == 1:  # what save_pretrained records: the dtype the weights are in
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(dtypes.pop()).removeprefix("torch.")
    return config


# A transformers config's sizes, under the names its model types give them: every such model holds a tensor of each.
_VOCAB, _WIDTH = ("vocab_size",), ("hidden_size", "n_embd", "d_model", "dim", "embed_dim")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _check_fits(facts: RunFacts, config: dict, weights: dict[str, torch.Tensor]) -> None:
    """The weights are those of the model the config describes: its vocabulary and width are sizes of its tensors,
    and its last layer's index is in their names. A record (model.json) that calls another model a transformers one
    is refused, not believed."""
    sizes = {size for t in weights.values() if t.dim() >= 2 for size in t.shape}
    parts = {part for name in weights for part in name.split(".") if part.isdigit()}
    for keys, fits in ((_VOCAB, lambda n: n in sizes), (_WIDTH, lambda n: n in sizes),
                       (_LAYERS, lambda n: n < 1 or str(n - 1) in parts)):
        key = next((k for k in keys if isinstance(config.get(k), int) and not isinstance(config.get(k), bool)), None)
        if key is not None and not fits(config[key]):
            shown = ", ".join(f"{name} {tuple(t.shape)}" for name, t in list(weights.items())[:4])
            raise CheckpointError(f"the run's HuggingFace config ({facts.describe()}) does not fit the checkpoint's "
                                  f"weights: {key}={config[key]} is no size or layer of theirs ({shown}, ...); "
                                  f"{_NOT_THIS_RUN}")


def write_hf(folder: Path, weights: dict[str, torch.Tensor], config: dict) -> dict[str, str]:
    """config.json and model.safetensors in `folder` (created if needed), each written atomically; tied weights
    once, under the name HuggingFace keeps (the module's first). Returns the names left out as aliases."""
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"--format hf writes a folder and {folder} is a file: name a folder")
    folder.mkdir(parents=True, exist_ok=True)
    left_out = safetensors_io.save_file(weights, folder / HF_WEIGHTS, {"format": "pt"})
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    safetensors_io.write_atomic(os.fspath(folder / HF_CONFIG), [text.encode()])
    return left_out


# -- Lightning -------------------------------------------------------------------------------------------------------
def lightning_checkpoint(facts: RunFacts, checkpoint: dict,
                         weights: dict[str, torch.Tensor]) -> tuple[dict, list, list]:
    """Lightning's checkpoint keys for load_from_checkpoint, the init arguments the user must pass as objects, and
    the keys left out because they name code.

    hyper_parameters: the model config's plain keys (minus _target_ and Hydra's other _keys_), overridden by what the
    module's save_hyperparameters() recorded at the run's start (model.json); a key whose value is an object
    (a node with its own _target_, or a value not plain data) is left out and named. Nothing that names code to call
    is written, whatever model.json holds: Lightning's `_instantiator` is imported and called at load."""
    if not facts.is_lightning():
        raise CheckpointError(f"--format lightning needs a run whose model is a LightningModule; this run's model is "
                              f"{facts.describe()}: {_other_formats(facts)}")
    config = {k: v for k, v in facts.model_cfg.items() if not (k.startswith("_") and k.endswith("_"))}
    objects = {k for k, v in config.items() if (isinstance(v, dict) and "_target_" in v) or not is_plain(v)}
    hparams = {k: v for k, v in config.items() if k not in objects}
    recorded = facts.record.get("hyper_parameters")
    recorded, named_code = plain_hyper_parameters(recorded if isinstance(recorded, dict) else {})
    hparams.update(recorded)
    listed = facts.record.get("objects")
    objects |= {str(k) for k in (listed if isinstance(listed, list) else ())
                if not names_code(str(k), None)} - set(hparams)
    out = {"epoch": checkpoint.get("epoch", 0), "global_step": checkpoint.get("step", 0),
           "pytorch-lightning_version": _lightning_version(), "state_dict": weights, "hyper_parameters": hparams}
    # What the module's on_save_checkpoint added: Lightning keeps it at the top level, where on_load_checkpoint reads.
    added = ((checkpoint.get("callbacks") or {}).get("lightning") or {}).get("module") or {}
    out.update((k, v) for k, v in added.items() if k not in out)
    return out, sorted(objects), named_code


def _lightning_version() -> str:
    """The installed Lightning's version, read from its metadata (not imported): Lightning migrates older ones."""
    for name in ("lightning", "pytorch-lightning"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    raise CheckpointError("--format lightning records the Lightning version that will read the file, and neither "
                          "lightning nor pytorch-lightning is installed here: pip install lightning, then export")


def _other_formats(facts: RunFacts) -> str:
    formats = ["torch (a .pt state_dict)", "safetensors"]
    if facts.is_lightning():
        formats.append("lightning")
    given = facts.model_cfg.get("config")
    if facts.record.get("kind") == "transformers" or (isinstance(given, dict) and "model_type" in given):
        formats.append("hf")
    return f"it can be written as {', '.join(formats)}"


def loading_hint(facts: RunFacts, target: Path, objects: list[str]) -> str:
    """The line a user types to load a Lightning export."""
    name = facts.target.rpartition(".")[2] if facts.target != "(unknown)" else "YourModule"
    extra = "".join(f", {k}=..." for k in objects)
    return f"load it with {name}.load_from_checkpoint({str(target)!r}{extra})"
