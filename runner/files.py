"""Writing a file of the run whole or not at all, and never through a symbolic link planted at its path.

Every file the runner writes in a run or sweep folder (checkpoints, metrics.json, model.json, the configs under
.hydra/, Hydra's own records) goes through a temporary file in the same folder and a rename over the path: a link
found there is replaced by the file, and what it points to is left as it was. Standard library only: the command line
writes Hydra's records before torch is imported.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path
from typing import Iterable


def write_atomic(path: str | os.PathLike, chunks: Iterable[bytes | memoryview]) -> None:
    """Through a temporary file in the target's folder and os.replace: never half a file at `path`, never a write
    through a link at `path` (the rename replaces the link itself). Raises the OSError of a failed write, after
    removing the temporary file."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "xb") as f:  # "x": a fresh file, never one (or a link) already there
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def write_text(path: str | os.PathLike, text: str) -> None:
    """`write_atomic` for text (UTF-8)."""
    write_atomic(path, [text.encode()])


def open_own(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """`os.open(path, flags | O_CREAT | O_NOFOLLOW)` for a file the runner keeps open in place (a lock): a link
    planted at `path` is removed and the file created in its place; what it pointed to is never opened."""
    flags |= os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(3):  # a link planted again between the removal and the open: at most twice, then refuse
        try:
            return os.open(path, flags, mode)
        except OSError as error:
            if error.errno != errno.ELOOP or not os.path.islink(path):
                raise
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # the link, not its target
    raise OSError(errno.ELOOP, "a symbolic link is planted there again and again", os.fspath(path))


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a folder's entries: a rename survives a power loss only once its directory is on disk. Some platforms
    and file systems refuse to open or fsync a folder; the write itself succeeded already."""
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


def linked_message(path: str | os.PathLike, target: str, what: str) -> str:
    """The one line for a symbolic link where the runner writes `what` (a log, its records)."""
    return (f"{path} is a symbolic link (to {target}); the runner never writes {what} through a link: remove it, or "
            "choose another hydra.run.dir")


def linked_folder(folder: str | os.PathLike) -> str:
    """What a symbolic link at `folder` points to, or '' where `folder` is no link: a run's `.hydra` that is a link
    would put its files wherever the link leads."""
    return os.readlink(folder) if Path(folder).is_symlink() else ""
