"""The first code of every process the launcher starts (popen: `python -m runner.entry`; spawn, fork and forkserver:
`main`).

It runs before the worker imports torch, which takes seconds. Before that the process leaves the terminal's process
group (a Ctrl-C reaches it once, through the launcher), arranges to end with the launcher, and takes the stop
signals: one that comes before the worker can stop at a step ends the process at once and quietly, as there is
nothing to save yet, rather than with a KeyboardInterrupt traceback per process. Then it leaves its pid where the
launcher looks for the processes to pass later signals on to, and hands over to `runner.worker`.

A forkserver worker is forked from a server started (and its imports made) before the job knew its settings: it
takes the launcher's environment, folder and import path as they are at the launch (`context`), keeping the
variables the agent set for its rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Optional

from runner import collector
from runner.processes import STOP_SIGNALS, WORKER_REGISTRY, end_with_parent

def _end_now(signum: int, frame: object) -> None:
    """End as a process without a handler would: by the signal, printing nothing (nothing needs closing yet)."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


# The environment this module was imported in: a forkserver's, before the agent set a rank's variables.
_IMPORTED_IN = dict(os.environ)


def _take_launch_context(context: dict) -> None:
    """The launcher's environment, folder and import path at the launch, the agent's variables for this rank kept.

    And the end of the server with the launcher: the server lives while any process holds its liveness pipe, which
    multiprocessing hands every worker too; a worker that kept it would keep the server alive after a launcher
    killed by SIGKILL, and the server, its parent, would never send it the signal that ends it with its parent."""
    from multiprocessing import forkserver

    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    agent = {key: value for key, value in os.environ.items() if _IMPORTED_IN.get(key) != value}
    os.environ.clear()
    os.environ.update({**context["env"], **agent})
    os.chdir(context["cwd"])
    sys.path[:] = context["path"]


def main(config_file: str, run_dir: str, context: Optional[dict] = None) -> None:
    """Run one launched worker on the resolved config file the launcher wrote (`context`: a forkserver worker's
    launch, see _take_launch_context)."""
    collector.pause()  # until the worker has imported the modules its config names (runner.collector)
    if context is not None:
        _take_launch_context(context)
    parent = os.getppid()
    end_with_parent()
    with contextlib.suppress(OSError):  # popen workers lead a session already
        os.setsid()
    for sig in STOP_SIGNALS:  # a forked worker would otherwise keep the launcher's handlers
        signal.signal(sig, _end_now)
    registry = os.environ.get(WORKER_REGISTRY)
    if registry:
        with contextlib.suppress(OSError):
            Path(registry, str(os.getpid())).touch()
    from runner.worker import run_from_file

    run_from_file(config_file, run_dir, parent)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
