"""Start the local worker processes of one job through torch.distributed.elastic, and report how they ended."""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Literal, Optional

from runner.errors import JobStopped, WorkerFailed
from runner.processes import (FOLLOWS_ANOTHER, PEER_GONE, SAME_REQUEST_S, STOP_SIGNALS, WORKER_REGISTRY, alive,
                              threads_per_process)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]

# What a forkserver imports before any worker is forked from it: torch and the worker's code, once per launcher
# process, at the start of its first job (runner.job), while the checks run; and torch._dynamo, which
# DistributedDataParallel's constructor imports (sympy with it: a second or more of CPU in each worker otherwise);
# runner.forkserver first, for how a worker whose launcher has already gone ends.
FORKSERVER_PRELOAD = ["runner.forkserver", "runner.entry", "runner.worker", "torch._dynamo"]


def start_forkserver() -> None:
    """Start this process's forkserver, its imports with it, if it is not running (it serves every later job)."""
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    # The server shares a resource tracker with this process, which at its exit lists the semaphores of the workers'
    # loader queues that a killed worker left (and cleans them up): said without a warning, the job's error stands
    # alone. The tracker takes this interpreter's warning options as it starts.
    options = list(sys.warnoptions)
    sys.warnoptions.append("ignore::UserWarning:multiprocessing.resource_tracker")
    try:
        with _helpers_ignore_the_terminal():
            resource_tracker.ensure_running()
            forkserver.ensure_running()
    finally:
        sys.warnoptions[:] = options


@contextlib.contextmanager
def _helpers_ignore_the_terminal() -> Iterator[None]:
    """SIGTERM and SIGHUP ignored while multiprocessing's helpers (the forkserver, the resource tracker) start: they
    keep it through their exec, so a signal to the terminal's whole group (a closed terminal, `kill -- -PGID`)
    reaches the launcher and the workers, which stop and save, and not the helpers they need meanwhile. A worker
    takes its own handlers as it starts (runner.entry)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stopped(run_dir: Path) -> bool:
    """Whether the job the workers ended is unfinished (its metrics.json records the stop signal): a signal that
    came once every step was taken stopped nothing (runner.loop.results), and the job ended as complete."""
    try:
        return bool(json.loads((run_dir / "metrics.json").read_text()).get("stop_signal"))
    except (OSError, ValueError, AttributeError):
        return True  # no record of a complete run: stopped


def _forkserver_pid() -> int:
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None) or -1


@contextlib.contextmanager
def _worker_environment(threads: int, deterministic: bool, scratch: Path, watched: bool) -> Iterator[None]:
    """Variables the workers inherit, set only around their start and restored afterwards; `threads`: each
    worker's (runner.processes.threads_per_process), in OMP_NUM_THREADS for torch and the libraries it loads."""
    from runner.heartbeat import HEARTBEAT_DIR
    from runner.loopback import loopback_interface

    saved = dict(os.environ)
    os.environ[WORKER_REGISTRY] = str(scratch / "workers")
    if watched:
        os.environ[HEARTBEAT_DIR] = str(scratch / "beats")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # popen workers import the experiment code from where the user ran the command.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    interface = loopback_interface()
    if interface:  # one node: gloo's and NCCL's connections between the workers listen on loopback alone
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = interface
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


SCRATCH_PREFIX = "runner-elastic-"


def remove_stale_scratch() -> None:
    """The temporary folders of launchers that were killed (SIGKILL leaves no time to remove them)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = folder.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)) and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)


def launcher_for(wanted: Any, max_restarts: int = 0, external: bool = False) -> Optional["ElasticLauncher"]:
    """What starts a job's workers: the processes its strategy asks for (`strategy.processes`, or None); one
    supervised worker when restarts are asked for, since a restart needs a process that outlives the worker,
    unless the processes were `external`ly created (torchrun, srun); else none."""
    if wanted is None and max_restarts and not external:
        return ElasticLauncher(1, "popen", max_restarts=max_restarts)
    if wanted is None:
        return None
    return ElasticLauncher(wanted.count, wanted.start_method, max_restarts=max_restarts,
                           stall_timeout=wanted.stall_timeout, stall_setting=wanted.stall_setting)


class ElasticLauncher:
    """`num_processes` workers on this node, each running `runner.entry` on the job's resolved config.

    `stall_timeout`: seconds a worker may go without progress before the job ends naming it (runner.heartbeat);
    None or 0: not watched. `stall_setting`: the setting that chose it, as its message names it.
    """

    launches = 0  # launches in this process (runner.cli: a command whose every job launched skips the teardown)

    def __init__(self, num_processes: int, start_method: StartMethod = "popen", max_restarts: int = 0,
                 shutdown_timeout: int = 30, stall_timeout: Optional[float] = None, stall_setting: str = "") -> None:
        self.num_processes = num_processes
        self.start_method = start_method
        self.max_restarts = max_restarts
        self.shutdown_timeout = shutdown_timeout
        self.stall_timeout = stall_timeout
        self.stall_setting = stall_setting or f"strategy.stall_timeout={stall_timeout}"

    def launch(self, config: Any, run_dir: Path, deterministic: bool = False) -> None:
        """Run the workers on `config` (the resolved job config) until they end; raise how a failed job failed."""
        from omegaconf import OmegaConf

        ElasticLauncher.launches += 1

        from runner.heartbeat import StallWatch

        # Loaded here, a forked worker finds the worker code (and torch) imported already.
        importlib.import_module("runner.worker")
        remove_stale_scratch()
        # The launch's private folder (mode 0700): the workers' config, error files, pids and heartbeats.
        scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
        for folder in ("workers", "beats"):
            (scratch / folder).mkdir()
        OmegaConf.save(config, scratch / "config.yaml")
        stop = _StopForwarder(self.shutdown_timeout, scratch / "workers")
        watch = StallWatch(scratch / "beats", self.num_processes, self.stall_timeout, run_dir, self.stall_setting) \
            if self.stall_timeout else contextlib.nullcontext()
        try:
            threads = threads_per_process(config.trainer.get("num_threads", "auto"), self.num_processes)
            with _worker_environment(threads, deterministic, scratch, bool(self.stall_timeout)), \
                    stop.installed(), watch, _quiet_agent():
                self._run_agent(scratch, run_dir, stop)
        except _AgentFailed as failed:
            if stop.signum:  # killed after the grace, or stopped now by a second Ctrl-C
                raise JobStopped(stop.signum, run_dir) from None
            if getattr(watch, "finished", False):  # a rank held a finished run: ended, and no error
                logging.getLogger("runner").warning("%s", watch.message)
                return
            if getattr(watch, "message", None):
                raise WorkerFailed(watch.rank, watch.message) from None
            raise failed.error from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if stop.signum and _stopped(run_dir):  # the workers stopped at a step, saved and returned
            raise JobStopped(stop.signum, run_dir)

    def _run_agent(self, scratch: Path, run_dir: Path, stop: "_StopForwarder") -> None:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        from runner import entry, loopback

        loopback.register()
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=self.num_processes,
            run_id=str(uuid.uuid4()),
            rdzv_backend=loopback.BACKEND,  # its store listens on 127.0.0.1 alone (c10d's on every interface)
            rdzv_endpoint=f"{loopback.ADDRESS}:0",
            max_restarts=self.max_restarts,
            monitor_interval=0.05,
            start_method="spawn" if self.start_method == "popen" else self.start_method,
            logs_specs=DefaultLogsSpecs(log_dir=str(scratch)),
            local_addr=loopback.ADDRESS,
            shutdown_timeout=self.shutdown_timeout,
            **stop.agent_signals(),
        )
        arguments = (str(scratch / "config.yaml"), str(run_dir))
        if self.start_method == "popen":
            entrypoint, args = sys.executable, ("-m", "runner.entry", *arguments)
        elif self.start_method == "forkserver":  # its server started before this launch: what the workers need now
            start_forkserver()
            context = {"env": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path)}
            entrypoint, args = entry.main, (*arguments, context)
        else:
            entrypoint, args = entry.main, arguments
        try:
            elastic_launch(config, entrypoint)(*args)
        except ChildFailedError as err:
            rank = _first_cause(err.failures)
            cause = _summary(err.failures[rank])
            # An error every rank met at once (a NaN loss reduced over them) is said once; a rank that only saw
            # another go away (or that the agent stopped after it) says nothing its log does not.
            summaries = {other: _summary(failure) for other, failure in err.failures.items()
                         if other != rank and not _consequence(failure)}
            others = "".join(f"\nthen rank {other}: {'the same' if _same(summary, cause) else summary}"
                             for other, summary in sorted(summaries.items()))
            raise _AgentFailed(WorkerFailed(rank, _describe(rank, err.failures[rank], run_dir) + others)) from None
        except SignalException as err:  # the agent passed the signal on and waited for the workers
            raise JobStopped(stop.signum or int(err.sigval), run_dir) from None


def _same(summary: str, cause: str) -> bool:
    """Two ranks' errors that differ in their numbers alone (a loader worker's pid) say the same."""
    return re.sub(r"\d+", "#", summary) == re.sub(r"\d+", "#", cause)


class _AgentFailed(Exception):
    """A worker failed: `error` says how, unless a stop signal or the stall watch explains it better."""

    def __init__(self, error: WorkerFailed) -> None:
        self.error = error
        super().__init__(str(error))


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent's own log lines repeat what WorkerFailed and JobStopped report (rank, exit code, traceback,
    signal); torch sets a level on each of its modules' loggers, so each is quietened."""
    # torch.multiprocessing's too: it warns of each worker it terminates after another failed (fork, forkserver).
    elastic_logs = [logging.getLogger("torch.distributed.elastic"), logging.getLogger("torch.multiprocessing")] + [
        logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
        if name.startswith(("torch.distributed.elastic.", "torch.multiprocessing."))]
    levels = [logger.level for logger in elastic_logs]
    for logger in elastic_logs:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(elastic_logs, levels):
            logger.setLevel(level)


class _StopForwarder:
    """The launcher's own handling of SIGTERM, SIGINT and SIGHUP while its workers run (Linux).

    torchelastic's agent, on such a signal, passes it on and then waits for the workers to *die*; but a spawn or
    fork worker that has stopped, saved and returned waits for the agent to collect its result, which an agent
    shutting down never does: the job ended only at the agent's SIGKILL, 30 s later. Here the agent is told to
    leave these signals alone (LaunchConfig.signals_to_handle); the launcher passes each one on to its workers
    and the agent keeps collecting them, so the job ends as soon as they have saved. If they have not ended
    `grace` seconds after the first signal, or on a second Ctrl-C, the agent kills them, with no restart.
    """

    def __init__(self, grace: int, registry: Path) -> None:
        from torch.distributed.launcher.api import LaunchConfig

        self.grace, self.registry = grace, registry
        self.signum = 0
        self._since = 0.0  # when the first signal came
        self._timer: threading.Timer | None = None
        self._expired = False
        self.active = (Path("/proc/self/stat").exists() and threading.current_thread() is threading.main_thread()
                       and "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)})

    def agent_signals(self) -> dict[str, str]:
        """LaunchConfig's setting: the signals the agent handles itself (SIGQUIT alone, when this one is active)."""
        return {"signals_to_handle": "SIGQUIT"} if self.active else {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if not self.active:
            yield  # the agent's own handling
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            if self._timer is not None:
                self._timer.cancel()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        repeat = self.signum and time.monotonic() - self._since < SAME_REQUEST_S  # the same request again
        if self._expired or (signum == signal.SIGINT and self.signum and not repeat):
            raise SignalException("the workers did not stop in time, or Ctrl-C came twice", signal.SIGKILL)
        if repeat:
            return  # the workers have it already
        if not self.signum:
            self.signum, self._since = signum, time.monotonic()
        workers = _workers(self.registry)
        if not workers:  # none has started its Python yet: the agent ends them, with no traceback of theirs
            raise SignalException(f"received {signal.Signals(signum).name}", signal.SIGTERM)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        if self._timer is None:
            self._timer = threading.Timer(self.grace, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        """The grace is over: the handler, run again in the main thread, has the agent kill the workers."""
        self._expired = True
        _thread.interrupt_main(self.signum)


def _workers(registry: Path) -> list[int]:
    """The pids the workers registered that are still this process's children (none is another's by now)."""
    found = []
    for entry in registry.iterdir() if registry.is_dir() else ():
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:  # ended
            continue
        # The fields after the name: state, ppid, ...; a forkserver worker is its server's child.
        if int(stat.rpartition(")")[2].split()[1]) in (os.getpid(), _forkserver_pid()):
            found.append(int(entry.name))
    return found


def _first_cause(failures: dict[int, object]) -> int:
    """The rank whose failure started it: the earliest one that is not a peer's death seen from the other side.

    The agent's own "first failure" goes by timestamps in whole seconds, and a killed worker leaves none of its
    own (the agent stamps it when it notices), so the survivors' "connection closed", or the SIGTERM the agent
    sent them, often looks as early.
    """
    def key(rank: int) -> tuple[bool, int, int]:
        return _consequence(failures[rank]), getattr(failures[rank], "timestamp", 0), rank
    return min(failures, key=key)


def _consequence(failure: object) -> bool:
    """Whether a rank failed only because another did: it lost its peer, or the agent stopped it after a failure."""
    trace = _trace(failure)
    if trace is None:  # on the first failure the agent SIGTERMs the others, and lists them as failed too
        return getattr(failure, "exitcode", None) == -signal.SIGTERM
    return any(pattern in trace.lower() for pattern in PEER_GONE) or FOLLOWS_ANOTHER in trace


def _trace(failure: object) -> str | None:
    data = getattr(failure, "error_file_data", None) or {}
    detail = data.get("message", {}) if isinstance(data, dict) else {}
    return detail.get("extraInfo", {}).get("py_callstack") if isinstance(detail, dict) else None


def _summary(failure: object) -> str:
    """One line: the last line of the traceback, or how the process ended."""
    trace = _trace(failure)
    if trace and any(pattern in trace.lower() for pattern in PEER_GONE):
        return "lost its connection to a rank that had ended (the details are in its log)"
    if trace and trace.strip():
        return trace.strip().splitlines()[-1].strip()
    return _ending(failure)


def _ending(failure: object) -> str:
    code = getattr(failure, "exitcode", None)
    name = getattr(failure, "signal_name", lambda: "")()
    return f"was killed by {name}" if code is not None and code < 0 else f"exited with code {code}"


def _describe(rank: int, failure: object, run_dir: Path) -> str:
    from runner.heartbeat import log_path

    trace = _trace(failure)
    if trace:
        hint = ""
        if "timed out" in trace.lower():
            hint = (f"\nrank {rank} waited longer than strategy.timeout in a collective that another rank never "
                    f"reached: that rank is stuck or slow (its log in {run_dir}: runner.log for rank 0, "
                    "rank_<k>.log for rank k)")
        if len(trace.strip().splitlines()) == 1 and not hint:  # a worker's own one-line report (a user error)
            return f"rank {rank}: {trace.strip()}"
        return f"rank {rank} failed:\n{trace.rstrip()}{hint}"
    return f"rank {rank} {_ending(failure)} (see its log: {log_path(run_dir, rank)})"
