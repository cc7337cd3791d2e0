"""What a checkpoint must show before the runner uses it: its checksums, a possible step, finite weights, its task."""

from __future__ import annotations

import os
import stat
from typing import Any, Optional

import torch

from runner.checkpoint_io.base import CheckpointError, CheckpointIO

MAX_STEP = 10**12  # a trillion optimizer steps: beyond any run, so only a damaged or edited file says more
TASK_KEY = "task"  # the class of the task the checkpoint was trained for, as "module.QualifiedName"


def load_file(io: CheckpointIO, path: Any, trust_unchecked: bool = False) -> dict:
    """A checkpoint file through `io`, refused without its checksum unless `trust_unchecked`.

    The runner's own IOs check the checksum; an IO of the user's (its own format) is trusted with its files.
    """
    from runner.checkpoint_io.async_io import AsyncCheckpointIO
    from runner.checkpoint_io.torch_io import TorchCheckpointIO

    refuse_special_file(path)
    inner = io.checkpoint_io if isinstance(io, AsyncCheckpointIO) else io
    if not isinstance(inner, TorchCheckpointIO):
        return io.load_checkpoint(path, map_location="cpu")
    return io.load_checkpoint(path, map_location="cpu", require_checksum=not trust_unchecked)


_SPECIAL = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"))


def refuse_special_file(path: Any) -> None:
    """A checkpoint file is a regular file: anything else is refused at once (reading a named pipe waits for a writer
    that may never come; a device never ends), a folder (not a sharded checkpoint) naming what it is."""
    from runner.checkpoint_io.formats import WEIGHTS_ALONE, foreign_format

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing or unreadable: the load says so
    if stat.S_ISDIR(mode):  # a sharded checkpoint is read as one before this; any other folder is none
        foreign = foreign_format(path)
        raise CheckpointError(f"{path} is {foreign}: {WEIGHTS_ALONE}" if foreign else
                              f"{path} is a folder, not a checkpoint (a sharded checkpoint holds a .metadata file)")
    kind = next((name for test, name in _SPECIAL if test(mode)), None)
    if kind is not None:
        raise CheckpointError(f"{path} is {kind}, not a checkpoint file or folder: reading it could wait forever; "
                              "name a checkpoint file (.ckpt) or a sharded checkpoint folder")


def task_name(task: Any) -> str:
    """How a checkpoint records the task (an instance or a class) it was trained for."""
    cls = task if isinstance(task, type) else type(task)
    return f"{cls.__module__}.{cls.__qualname__}"


def position_problem(checkpoint: dict) -> str:
    """What is impossible about the checkpoint's step, epoch and place in the epoch ('' when nothing)."""
    for key, limit in (("step", MAX_STEP), ("epoch", MAX_STEP), ("samples_in_epoch", None)):
        value = checkpoint.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (limit and value > limit):
            bound = f"0 to {limit:.0e}" if limit else "0 or more"
            return f"its {key} is {value!r}, not a whole number from {bound}: the file was damaged or edited"
    return ""


def task_problem(checkpoint: dict, task: Optional[str]) -> str:
    """'' when the checkpoint was trained for `task` or does not say (older checkpoints; their model's shapes
    are checked instead)."""
    saved = checkpoint.get(TASK_KEY)
    if task is None or saved is None or saved == task:
        return ""
    return f"it was trained for task {saved}, this run's task is {task}; resume with the task it was saved with"


def nonfinite_weights(model_state: Any) -> list[str]:
    """The keys of model tensors holding NaN or inf (tensors on the meta device hold nothing to check)."""
    if not isinstance(model_state, dict):
        return []
    return [key for key, value in model_state.items()
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.device.type != "meta"
            and not bool(torch.isfinite(value).all())]


def check(path: Any, checkpoint: dict, task: Optional[str] = None, weights: bool = True,
          nonfinite: Optional[list[str]] = None) -> None:
    """CheckpointError naming `path` when the checkpoint's step, weights or task cannot be used.

    `weights=False`: the weights are not looked at (a sharded model's, checked before start); `nonfinite`: the
    keys found non-finite elsewhere (a sharded folder's, chunk by chunk)."""
    problems = [position_problem(checkpoint), task_problem(checkpoint, task)]
    bad = nonfinite if nonfinite is not None else nonfinite_weights(checkpoint.get("model")) if weights else []
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        problems.append(f"its weights {', '.join(bad[:3])}{more} hold NaN or inf; use an earlier checkpoint")
    problems = [p for p in problems if p]
    if problems:
        name = f"checkpoint {os.fspath(path)}" if path is not None else "the checkpoint"
        raise CheckpointError(f"cannot use {name}: {'; '.join(problems)}")
