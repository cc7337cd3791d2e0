"""One live run per run folder: an exclusive lock on a file in it, held for the run's lifetime.

`fcntl.flock` belongs to the open file: the kernel releases it when the process that took it ends, however it
ends (SIGKILL too), so a crashed run never blocks the next one in its folder. The file holds the pid of the
process that took it, for the message a second run gets, and is removed when the run ends. A symbolic link planted
at its path is replaced by the lock file (runner.files.open_own), never opened: its target keeps its content.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path

from runner import files

LOCK_FILE = Path(".hydra") / "run.lock"

# The folders this process holds: folder -> [file descriptor, how many holds, the holding thread]. A process takes
# a folder once (a second flock of the same file from this process would succeed on its own lock); the thread that
# took it may take it again (the CLI, then fit()), another thread of the process is refused like another process.
_held: dict[Path, list[int]] = {}


class RunFolderBusy(RuntimeError):
    """Another live process runs a job in this run folder."""

    def __init__(self, run_dir: Path, pid: str) -> None:
        self.run_dir, self.pid = run_dir, pid
        owner = f"process {pid}" if pid else "another process"
        super().__init__(f"{run_dir} is in use by a running job ({owner}); wait for it to end, or choose another "
                         "folder with hydra.run.dir=<folder>")

    def __reduce__(self) -> tuple:
        # A sweep's parallel launcher (joblib) sends a job's error back to the sweep in a pickle.
        return type(self), (self.run_dir, self.pid)


def acquire(run_dir: Path) -> None:
    """Take `run_dir` for this process (again, if it holds it already), or raise RunFolderBusy."""
    folder = Path(run_dir).absolute()
    if folder in _held:
        if _held[folder][2] != threading.get_ident():
            raise RunFolderBusy(folder, f"{os.getpid()}, another thread")
        _held[folder][1] += 1
        return
    path = folder / LOCK_FILE
    refuse_linked_records(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = files.open_own(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise RunFolderBusy(folder, pid) from None
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed the file as it ended, after this process opened it: open the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[folder] = [fd, 1, threading.get_ident()]


def refuse_linked_records(folder: Path) -> None:
    """A run's `.hydra` folder that is a symbolic link is refused in one line: every record the run keeps there (its
    lock, its configs) would be written wherever the link leads."""
    target = files.linked_folder(folder)
    if target:
        from runner.config import ConfigError

        raise ConfigError([files.linked_message(folder, target, "its records")])


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, now = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def release(run_dir: Path) -> None:
    """Give up one hold of `run_dir`; the last one removes the file (while still holding it) and unlocks it.
    A process killed before leaves the file, unlocked: the next run takes it."""
    folder = Path(run_dir).absolute()
    entry = _held.get(folder)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _held[folder]
        if _same_file(entry[0], folder / LOCK_FILE):
            with contextlib.suppress(OSError):
                (folder / LOCK_FILE).unlink()
        os.close(entry[0])


def release_all() -> None:
    for folder in list(_held):
        _held[folder][1] = 1
        release(folder)
