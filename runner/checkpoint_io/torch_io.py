"""Checkpoint IO on torch.save/torch.load: atomic writes, weights-only loads."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from typing import Any

import torch

from runner.checkpoint_io.base import CheckpointError, CheckpointIO

_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class TorchCheckpointIO(CheckpointIO):
    """Writes through a temporary file and `os.replace`, so a crash never leaves half a checkpoint."""

    def save_checkpoint(
        self, checkpoint: dict, path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"TorchCheckpointIO.save_checkpoint does not support storage_options "
                f"(got {storage_options!r}); pass storage_options=None"
            )
        path = os.fspath(path)
        try:
            _write_atomic(checkpoint, path)
        except Exception as err:
            raise CheckpointError(
                f"cannot write checkpoint {path}: {_one_line(err)}; the previous file is left intact"
            ) from err

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any = "cpu") -> dict:
        path = os.fspath(path)
        try:
            checkpoint = torch.load(path, map_location=map_location, weights_only=True)
        except FileNotFoundError as err:
            raise CheckpointError(f"checkpoint not found: {path}") from err
        except Exception as err:
            raise CheckpointError(
                f"cannot load checkpoint {path}: {_load_reason(err)}; "
                "checkpoints must hold only tensors, dicts, lists and numbers"
            ) from err
        if not isinstance(checkpoint, dict):
            raise CheckpointError(
                f"cannot load checkpoint {path}: it holds a {type(checkpoint).__name__}, "
                "expected a dict such as {'model': ..., 'optimizer': ..., 'step': ...}"
            )
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.fspath(path))


def _write_atomic(checkpoint: dict, path: str) -> None:
    # The temporary file lives in the target's directory: os.replace is atomic only within one filesystem.
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    name = f".{os.path.basename(path)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp = os.path.join(directory, name)
    try:
        # 0o666 under the umask, so the checkpoint gets the same mode a plain open() would give it.
        with os.fdopen(os.open(tmp, _TMP_FLAGS, 0o666), "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    # The rename survives a power loss only once the directory entry is flushed; some platforms
    # and filesystems refuse to open or fsync a directory, and the write itself already succeeded.
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _one_line(err: BaseException) -> str:
    text = " ".join(_ANSI.sub("", str(err)).split())
    return text or f"{type(err).__name__} (the file is empty or truncated)"


def _load_reason(err: BaseException) -> str:
    # torch's weights-only refusal is several paragraphs; the useful part follows this marker.
    text = _one_line(err)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1].split("Check the documentation", 1)[0].strip()
    elif isinstance(err, OSError) and err.filename is None:
        # A read past the end of a truncated zip surfaces as a bare errno such as EINVAL.
        text = f"the file is corrupt or truncated ({text})"
    first_sentence = re.match(r"(.+?)\.(\s|$)", text)
    return first_sentence.group(1) if first_sentence else text
