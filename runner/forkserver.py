"""Imported by the launcher's forkserver (runner.launch.FORKSERVER_PRELOAD), once, before it forks any worker.

A worker forked from the server first unpickles what its launcher sent it: the process object, with the semaphores
of torch's error queues. A launcher stopped by a signal in that moment (a Ctrl-C before any worker had registered)
ends at once and removes those semaphores, and the half-made worker then failed with a 14-line FileNotFoundError
traceback from multiprocessing, after the launcher's own line. That worker never ran any of the job's code: it ends
quietly. Any other error of a worker's start keeps its traceback.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Callable, Optional


def _semaphores_gone(kind: type, trace: Optional[TracebackType]) -> bool:
    """Whether the error is a semaphore of the launcher that no longer exists, met while unpickling it."""
    last = None
    while trace is not None:
        last, trace = trace, trace.tb_next
    where = last.tb_frame.f_code.co_filename.replace("\\", "/") if last is not None else ""
    return issubclass(kind, FileNotFoundError) and where.endswith("multiprocessing/synchronize.py")


def quiet_when_the_launcher_is_gone(previous: Callable) -> Callable:
    """`previous` (an excepthook), silent for a worker whose launcher removed its semaphores before it started."""

    def hook(kind: type, error: BaseException, trace: Optional[TracebackType]) -> None:
        if not _semaphores_gone(kind, trace):
            previous(kind, error, trace)

    return hook


sys.excepthook = quiet_when_the_launcher_is_gone(sys.excepthook)
