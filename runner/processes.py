"""What the launcher, each worker's first code (runner.entry) and the worker agree on about processes.

The stop signals and how soon a repeat is the same request, where workers register their pids, how a process
ends with its parent, whether a pid is alive, how a rank's error reads when another rank's process went away, and
how many threads each process of a node runs.
Standard library only: every process of a launch imports it first, before torch.
"""

from __future__ import annotations

import os
import signal
from typing import Any

# The folder where each worker of a launch leaves a file named by its pid: the processes stop signals go to.
WORKER_REGISTRY = "RUNNER_WORKER_REGISTRY"
# SIGHUP too: a closed terminal or SSH session reaches the launcher, which passes it on to the workers.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# One Ctrl-C can arrive twice within milliseconds: from the terminal to the whole process group, and again from a
# wrapper that passes it on (timeout, a shell script, srun). A second one this soon is the same request, not
# "Ctrl-C twice: stop now, without saving".
SAME_REQUEST_S = 0.2
# What a rank raises when another rank's process went away under a collective: a consequence, not a cause.
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote worker crashing",
             "remote process exited")
# How a rank's own error says it only follows another rank's (a data hook that failed on local rank 0): the
# launcher names the rank where it failed, not this one.
FOLLOWS_ANOTHER = "that process's log has the error"


def end_with_parent() -> None:
    """Linux: SIGTERM this process when its launcher dies, even by SIGKILL, so no orphan keeps training."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own shutdown still ends the workers in the usual cases


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        pass
    return True


def state(pid: int) -> str:
    """Linux's state of process `pid` (R running, S sleeping, T stopped, Z ended but not collected, ...); '' when
    there is no such process, or where /proc does not say."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[0]  # the field after the name, which may hold spaces and parentheses


def running(pid: int) -> bool:
    """Whether process `pid` still runs: it exists and has not ended (a child not yet collected has)."""
    return state(pid) not in ("", "Z", "X")


def peer_gone(error: BaseException) -> bool:
    """The error a rank gets when another rank's process went away under a collective: a consequence."""
    text = f"{type(error).__name__}: {error}".lower()
    return isinstance(error, (RuntimeError, OSError)) and any(pattern in text for pattern in PEER_GONE)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (a container's or a cluster job's cpuset), and no more than
    SLURM's cpus-per-task where the job sets it (a node shared by jobs need not pin them to their CPUs)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity outside Linux
        cpus = os.cpu_count() or 1
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        cpus = min(cpus, int(slurm))
    return max(cpus, 1)


def threads_per_process(setting: Any, local_processes: int) -> int:
    """The intra-op threads of each of the `local_processes` processes that share this process's CPUs:
    `trainer.num_threads` when it is a number; with `auto`, the user's OMP_NUM_THREADS when set, else the usable
    CPUs divided over the processes (torch's default, a thread per core in every process, oversubscribes a node
    that several processes or jobs share)."""
    if setting != "auto":
        return int(setting)
    chosen = os.environ.get("OMP_NUM_THREADS", "")
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    return max(1, usable_cpus() // max(local_processes, 1))
