"""`python -m runner.export <run dir or checkpoint> <file>`: a checkpoint's model weights as one plain state_dict file.

A sharded checkpoint (a folder, strategy=fsdp) is read whole in this one process, without a process group;
a full checkpoint file works too. Either is verified against the checksums written with it (`--trust-unchecked`
loads one without them) and refused with NaN/inf weights or an impossible step. The result is the model's own
`state_dict` (no optimizer, no training state), written atomically and loadable with
`torch.load(file, weights_only=True)` into the model as built.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch

from runner.checkpoint_io import CheckpointError, TorchCheckpointIO, sharded, trust


def checkpoint_of(source: Path) -> Path:
    """`source` itself, or a run folder's checkpoints/last.ckpt."""
    last = source / "checkpoints" / "last.ckpt"
    if source.is_dir() and not sharded.is_sharded(source):
        if last.exists():
            return last
        raise CheckpointError(f"{source} is neither a checkpoint nor a run folder with checkpoints/last.ckpt")
    return source


def export(source: Path, target: Path, trust_unchecked: bool = False) -> dict[str, torch.Tensor]:
    """Write the model weights of the checkpoint at (or the run folder) `source` to `target`; returns them."""
    path = checkpoint_of(Path(source))
    _check_target(path, Path(target))
    if sharded.is_sharded(path):
        checkpoint = sharded.read(path, trust_unchecked=trust_unchecked)
    else:
        checkpoint = trust.load_file(TorchCheckpointIO(), path, trust_unchecked)
    if not isinstance(checkpoint.get("model"), dict):
        raise CheckpointError(f"{path} is not a runner checkpoint: it has no model weights")
    trust.check(path, checkpoint)
    weights = {key: value.contiguous() for key, value in checkpoint["model"].items()}
    TorchCheckpointIO(checksum=False).save_checkpoint(weights, target)  # nothing but the model's keys
    return weights


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
    parser = argparse.ArgumentParser(prog="python -m runner.export", description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="a run folder, a checkpoint folder (sharded) or a checkpoint file")
    parser.add_argument("target", type=Path, help="the state_dict file to write")
    parser.add_argument("--trust-unchecked", action="store_true",
                        help="read a checkpoint that carries no checksums (written by other tools or older versions)")
    args = parser.parse_args(argv)
    try:
        weights = export(args.source, args.target, args.trust_unchecked)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    count = sum(t.numel() for t in weights.values())
    print(f"wrote {args.target}: {len(weights)} tensors, {count:,} parameters and buffers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
