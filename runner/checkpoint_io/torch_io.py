"""Checkpoint IO on torch.save/torch.load: atomic writes, weights-only loads."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import sys
import zlib
from typing import Any, Optional

import torch

from runner.checkpoint_io.base import CheckpointError, CheckpointIO
from runner.files import fsync_dir

_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
CHECKSUM_KEY = "checksum_crc32"  # of everything else in the checkpoint, checked when it is loaded


class TorchCheckpointIO(CheckpointIO):
    """Writes through a temporary file and `os.replace`, so a crash never leaves half a checkpoint.

    `checksum=False` writes the dict exactly as given (a plain state_dict for `load_state_dict`, strict).
    """

    def __init__(self, checksum: bool = True) -> None:
        self.checksum = checksum

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
            _write_atomic({**checkpoint, CHECKSUM_KEY: checksum(checkpoint)} if self.checksum else checkpoint, path)
        except Exception as err:
            raise CheckpointError(
                f"cannot write checkpoint {path}: {_write_reason(err, path)}; the previous file is left intact"
            ) from err

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any = "cpu",
                        require_checksum: Optional[bool] = None) -> dict:
        """The checkpoint at `path`, checked against its checksum. A file without one (saved by other tools, or
        with its checksum deleted) loads silently by default; `require_checksum=True` refuses it, False warns."""
        path = os.fspath(path)
        try:
            checkpoint = torch.load(path, map_location=map_location, weights_only=True)
        except FileNotFoundError as err:
            raise CheckpointError(f"checkpoint not found: {path}") from err
        except Exception as err:
            from runner.checkpoint_io.formats import WEIGHTS_ALONE, foreign_format

            # torch reads safetensors itself: its reader's words say so where the header is too damaged to tell
            foreign = foreign_format(path) or ("a safetensors file" if "deserializing header" in str(err) else None)
            if foreign:  # neither damaged nor a pickle: another tool's format (that does not even read here)
                advice = f"it is {foreign}: {WEIGHTS_ALONE}"
            elif _damaged(err):
                advice = "the file is damaged, truncated or not a checkpoint; use an earlier checkpoint"
            else:
                advice = "checkpoints must hold only tensors, dicts, lists and numbers"
            raise CheckpointError(f"cannot load checkpoint {path}: {_load_reason(err)}; {advice}") from err
        if not isinstance(checkpoint, dict):
            raise CheckpointError(
                f"cannot load checkpoint {path}: it holds a {type(checkpoint).__name__}, "
                "expected a dict such as {'model': ..., 'optimizer': ..., 'step': ...}"
            )
        stored = checkpoint.pop(CHECKSUM_KEY, None)  # files written elsewhere have none
        # A dict that is no training checkpoint at all (no model and step) is named as such by the caller.
        if stored is None and require_checksum is not None and {"model", "step"} <= checkpoint.keys():
            from runner.checkpoint_io.manifest import UNCHECKED_ADVICE, log

            if require_checksum:
                raise CheckpointError(f"cannot load checkpoint {path}: it carries no {CHECKSUM_KEY}, so "
                                      f"{UNCHECKED_ADVICE}")
            log.warning("loading %s without a checksum (trust_unchecked_checkpoint): damage or edits are not "
                        "detected", path)
        if stored is not None and stored != checksum(checkpoint):
            raise CheckpointError(
                f"cannot load checkpoint {path}: its contents do not match the checksum written with them (the "
                "file was damaged or changed after it was saved); use an earlier checkpoint"
            )
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.fspath(path))  # a sharded folder is the strategy's to remove, never any other folder


def _write_atomic(checkpoint: dict, path: str) -> None:
    # The temporary file lives in the target's directory: os.replace is atomic only within one filesystem.
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, ".metadata")):
        # A sharded checkpoint (strategy=fsdp ran here before) is replaced; any other folder is not ours to remove.
        raise IsADirectoryError(21, "a folder that is not a sharded checkpoint is there", path)
    name = f".{os.path.basename(path)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp = os.path.join(directory, name)
    try:
        # 0o666 under the umask, so the checkpoint gets the same mode a plain open() would give it.
        with os.fdopen(os.open(tmp, _TMP_FLAGS, 0o666), "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def replace(new: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put the finished file or folder `new` at `path`, whatever is there now (a checkpoint file where a sharded
    folder was, or the reverse): `path` always holds a whole checkpoint, the old one is removed after."""
    old_is_folder = os.path.isdir(path) and not os.path.islink(path)
    if not (old_is_folder or os.path.isdir(new)) or not os.path.lexists(path):
        os.replace(new, path)  # file over file, or nothing there: one atomic rename
        return
    if exchange(new, path):
        remove_path(new)  # now the previous checkpoint
        return
    # No atomic swap here: move the old one aside first (a crash now leaves it there, named).
    aside = os.path.join(os.path.dirname(os.path.abspath(path)),
                         f".{os.path.basename(path)}.old-{secrets.token_hex(4)}")
    os.replace(path, aside)
    os.replace(new, path)
    remove_path(aside)


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def remove_path(path: str | os.PathLike) -> None:
    """Remove a checkpoint file or folder; nothing there is fine."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def checksum(tree: Any) -> int:
    """CRC-32 of a checkpoint's structure and values: every key, number and string, and each tensor's dtype,
    shape and bytes. A flipped byte in a tensor's data loads without an error from torch; this finds it."""
    return _crc(tree, 0)


def _crc(node: Any, crc: int) -> int:
    if isinstance(node, torch.Tensor):
        crc = zlib.crc32(f"T{node.dtype}{tuple(node.shape)}".encode(), crc)
        if node.layout != torch.strided or node.device.type == "meta":
            return crc
        data = node.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return zlib.crc32(memoryview(data.numpy()), crc) if data.numel() else crc
    if isinstance(node, dict):
        crc = zlib.crc32(b"{", crc)
        for key, value in node.items():
            crc = _crc(value, zlib.crc32(repr(key).encode(), crc))
        return zlib.crc32(b"}", crc)
    if isinstance(node, (list, tuple)):
        crc = zlib.crc32(b"[", crc)
        for value in node:
            crc = _crc(value, crc)
        return zlib.crc32(b"]", crc)
    return zlib.crc32(f"{type(node).__name__}:{node!r}".encode(), crc)


def _write_reason(err: BaseException, path: str) -> str:
    """torch.save reports a full disk as an 'unexpected pos' of its zip writer: say what it means."""
    text = _one_line(err)
    full = isinstance(err, OSError) and err.errno == 28  # ENOSPC
    if full or "unexpected pos" in text or "file write failed" in text:
        try:
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        except OSError:
            return f"the write failed: is the disk full? ({text})"
        return (f"the write failed: the disk is full or a quota was reached ({free / 2**20:.1f} MiB free there; "
                f"{text})")
    return text


def _one_line(err: BaseException) -> str:
    text = " ".join(_ANSI.sub("", str(err)).split())
    return text or f"{type(err).__name__} (the file is empty or truncated)"


def _damaged(err: BaseException) -> bool:
    """A load failure from the bytes themselves, not from objects torch's weights-only loader refuses.

    A flipped byte in the pickle shows up as an opcode the loader does not know, a global that is not a name
    (bytes that spell no identifier), or a name missing from a module loaded already (`collections.OrderddDict`).
    Nothing is imported to decide: a module the file names could run code. Any other global was saved on purpose.
    """
    text = _one_line(err)
    # A stack underflow, a memo look-up past its end or a name that is no UTF-8: the unpickler read bytes at random.
    if isinstance(err, (OSError, EOFError, KeyError, IndexError, UnicodeDecodeError)) or re.search(r"PytorchStreamReader|ZIP archive|central directory|"
                                                         r"Unsupported operand|invalid load key|truncated", text):
        return True
    unsupported = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if unsupported:
        module, _, name = unsupported.group(1).rpartition(".")
        if not (_IDENTIFIERS.fullmatch(module) and name.isidentifier()):
            return True
        loaded = sys.modules.get(module)  # a look-up, never an import
        return loaded is not None and name not in vars(loaded)
    return False


_IDENTIFIERS = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _load_reason(err: BaseException) -> str:
    # torch's weights-only refusal is several paragraphs; the useful part follows this marker.
    text = _one_line(err)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1].split("Check the documentation", 1)[0].strip()
    elif isinstance(err, KeyError):  # torch's reader of its legacy format, on bytes of another kind
        text = f"not a torch file (KeyError {text})"
    elif isinstance(err, OSError) and err.filename is None:
        # A read past the end of a truncated zip surfaces as a bare errno such as EINVAL.
        text = f"the file is corrupt or truncated ({text})"
    first_sentence = re.match(r"(.+?)\.(\s|$)", text)
    return first_sentence.group(1) if first_sentence else text
