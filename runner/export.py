"""`python -m runner.export <run dir or checkpoint> <target>`: a checkpoint's model weights in the format the
model's ecosystem reads.

The format follows the target's name, or `--format`:
  torch        (default) the model's own `state_dict`, for `torch.load(file, weights_only=True)`
  safetensors  (a target ending in .safetensors) for `safetensors.torch.load_file`; tied weights written once
  hf           a `save_pretrained` folder (config.json, model.safetensors) for `AutoModel*.from_pretrained(folder)`,
               for a run whose model is a transformers PreTrainedModel (its config: the run's model.json, or
               model.config given as data with its model_type)
  lightning    a checkpoint for `YourModule.load_from_checkpoint(file)`, for a run whose model is a LightningModule
A sharded checkpoint (a folder, strategy=fsdp) is read whole in this one process, without a process group;
a full checkpoint file works too. Either is verified against the checksums written with it (`--trust-unchecked`
loads one without them) and refused with NaN/inf weights or an impossible step. No optimizer or training state is
written, every file atomically; nothing the run folder names is imported and nothing but tensors is unpickled.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, get_args

import torch

from runner.checkpoint_io import CheckpointError, TorchCheckpointIO, formats, safetensors_io, sharded, trust

Format = Literal["torch", "safetensors", "hf", "lightning"]


@dataclass
class Exported:
    """What was written: the model's weights (every name, aliases included) and lines for the user."""

    weights: dict[str, torch.Tensor]
    notes: list[str] = field(default_factory=list)


def checkpoint_of(source: Path) -> Path:
    """`source` itself, or a run folder's checkpoints/last.ckpt."""
    last = source / "checkpoints" / "last.ckpt"
    if source.is_dir() and not sharded.is_sharded(source):
        if last.exists():
            return last
        raise CheckpointError(f"{source} is neither a checkpoint nor a run folder with checkpoints/last.ckpt")
    return source


def format_of(target: Path) -> Format:
    """safetensors for a .safetensors target, else torch: hf and lightning are asked for by --format."""
    return "safetensors" if target.suffix == ".safetensors" else "torch"


def export(source: Path, target: Path, trust_unchecked: bool = False, fmt: Optional[Format] = None) -> Exported:
    """Write the model weights of the checkpoint at (or the run folder) `source` to `target` in `fmt`."""
    source, target = Path(source), Path(target)
    fmt = fmt or format_of(target)
    if fmt not in get_args(Format):
        raise CheckpointError(f"--format {fmt} is not a format: use one of {', '.join(get_args(Format))}")
    path = checkpoint_of(source)
    _check_target(path, target)
    if sharded.is_sharded(path):
        checkpoint = sharded.read(path, trust_unchecked=trust_unchecked)
    else:
        checkpoint = trust.load_file(TorchCheckpointIO(), path, trust_unchecked)
    if not isinstance(checkpoint.get("model"), dict):
        raise CheckpointError(f"{path} is not a runner checkpoint: it has no model weights")
    trust.check(path, checkpoint)
    if fmt == "torch":
        weights = {key: value.contiguous() for key, value in checkpoint["model"].items()}
        TorchCheckpointIO(checksum=False).save_checkpoint(weights, target)  # nothing but the model's keys
        return Exported(weights)
    weights = dict(checkpoint["model"])  # as loaded: tensors that share memory still do, so ties are seen
    facts = formats.RunFacts(formats.run_dir_of(source, path), checkpoint)
    if fmt == "safetensors":
        return Exported(weights, _aliases_note(safetensors_io.save_file(weights, target, {"format": "pt"})))
    if fmt == "hf":
        if sharded.is_sharded(target):
            raise CheckpointError(f"{target} is a sharded checkpoint: write the HuggingFace folder elsewhere")
        config = formats.hf_config(facts, weights)
        return Exported(weights, _aliases_note(formats.write_hf(target, weights, config)))
    lit, objects, named_code = formats.lightning_checkpoint(facts, checkpoint, weights)
    TorchCheckpointIO(checksum=False).save_checkpoint(lit, target)
    left_out = [f"left out of hyper_parameters: {', '.join(named_code)} (they name code a loader would call)"]
    return Exported(weights, [formats.loading_hint(facts, target, objects), *(left_out if named_code else [])])


def _aliases_note(left_out: dict[str, str]) -> list[str]:
    if not left_out:
        return []
    pairs = ", ".join(f"{name} = {kept}" for name, kept in sorted(left_out.items()))
    return [f"tied weights written once ({pairs}): safetensors.torch.load_model or from_pretrained ties them again"]


def _check_target(source: Path, target: Path) -> None:
    """Never replace a training checkpoint (the source above all) by bare weights."""
    resolved = target.resolve()
    if resolved == source.resolve() or source.resolve() in resolved.parents:
        raise CheckpointError(f"{target} is the checkpoint being exported: write the weights to another file")
    if target.is_file():
        try:
            existing = torch.load(target, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - not a checkpoint we could read: any other file may be replaced
            return
        if isinstance(existing, dict) and {"model", "optimizer", "step"} <= existing.keys():
            raise CheckpointError(f"{target} is a training checkpoint (step {existing['step']}); exporting over it "
                                  "would lose its optimizer and position: write the weights to another file")


def main(argv: Optional[list[str]] = None) -> int:
    summary, details = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="python -m runner.export", description=summary, epilog=details,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("source", type=Path, help="a run folder, a checkpoint folder (sharded) or a checkpoint file")
    parser.add_argument("target", type=Path, help="the file to write (the folder, for --format hf)")
    parser.add_argument("--format", choices=get_args(Format), default=None,
                        help="torch, safetensors, hf or lightning (default: safetensors for a .safetensors target, "
                             "else torch)")
    parser.add_argument("--trust-unchecked", action="store_true",
                        help="read a checkpoint that carries no checksums (written by other tools or older versions)")
    args = parser.parse_args(argv)
    try:
        exported = export(args.source, args.target, args.trust_unchecked, args.format)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    weights = exported.weights
    count = sum(t.numel() for t in weights.values())
    fmt = args.format or format_of(args.target)
    print(f"wrote {args.target}: {len(weights)} tensors, {count:,} parameters and buffers, as {fmt}")
    for note in exported.notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
