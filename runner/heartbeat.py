"""Progress beats: each launched worker marks its steps in a small file, and the launcher's watch names a rank
that stopped advancing, with its Python stack, long before a collective's timeout ends the job.

A beat is one `pwrite` of a few bytes from the host (no device sync, no fsync). A rank stuck in its step leaves
the others waiting in the step's collective, so every rank goes quiet; the stuck one is the rank that got least
far: the beats count the step and the forward passes within it (a rank blocked in the gradient reduction has
finished its forward, one stuck in its forward or its data has not). Checkpoint saves, which can outlast any
step, pause the watch of the ranks in them.

Before the first step the beats name a phase (the import of the modules the config names, prepare_data, setup, the
rest of the start), numbered alike on every rank: a rank waiting in a collective for a peer has reached a later phase
than the peer, so the earliest is named.
After the last step two more: the end of the run (its last writes, the test after training, waiting for the other
ranks) and its exit; a rank whose process has ended counts as the furthest of all, so a rank that holds the job
after the others have ended (stopped by SIGSTOP, stuck in its exit) is named too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Optional

from runner.processes import running, state

# Set by the launcher in the workers' environment: the private folder of the launch where beats go.
HEARTBEAT_DIR = "RUNNER_HEARTBEAT_DIR"
# How much longer than the longest pause seen between beats a rank may be quiet before it counts as stuck.
SLOWEST_PAUSE_FACTOR = 10
# Once a rank has finished and ended, how long another may stay quiet at most (its teardown and exit are left): a
# rank stopped after `done:` holds the job this long, not the stall timeout's minutes.
EXIT_GRACE_S = 30.0
DUMP_SIGNAL = signal.SIGUSR2  # on it each launched worker dumps its Python stacks (faulthandler)
# A worker's phases, in the order every rank goes through them (a rank that skips one goes on to the next).
IMPORT, START, PREPARE, PREPARED, SETUP, BUILT, STEPS, END, DONE = range(9)
_WIDTH = 160  # of a record: a shorter one never leaves the tail of a longer one behind

log = logging.getLogger("runner")


class NoHeartbeat:
    """The heartbeat of a process no launcher watches (one process, torchrun, srun): does nothing."""

    def step(self, step: int) -> None:
        pass

    def phase(self, phase: int, label: str) -> None:
        pass

    def pause(self) -> None:
        pass


class Heartbeat:
    """This process's beat file `<folder>/<rank>`: 'pid step ticks paused steps phase label', rewritten in place at
    each beat (`steps`: how many steps this process has started, whatever step it resumed at; `phase` and `label`:
    where it is before its first step, see `phase`).

    `step(n)` at the start of each optimizer step (n steps done); `tick` after each forward pass (a forward hook);
    the checkpoint hooks pause the watch around a save; the end of the run and the exit are phases (END, DONE).
    """

    def __init__(self, folder: Path, rank: int) -> None:
        self._fd = os.open(Path(folder) / str(rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self._pid, self._step, self._ticks, self._paused, self._steps = os.getpid(), -1, 0, 0, 0
        self._phase, self._label = IMPORT, "the import of the modules its config names"
        self._write()

    def step(self, step: int) -> None:
        self._step, self._ticks, self._steps, self._paused, self._phase = step, 0, self._steps + 1, 0, STEPS
        self._write()

    def phase(self, phase: int, label: str) -> None:
        """Entering `phase` (one of IMPORT..BUILT before the first step, END or DONE after the last), watched again
        after a pause; `label` names it in the stall message ("rank 1 made no progress for 10 s in <label>")."""
        self._phase, self._label, self._ticks, self._paused = phase, label[:100], 0, 0
        self._write()

    def pause(self) -> None:
        """Until the next step or phase: what follows (an evaluation stage, the logger's last upload) is not
        watched."""
        self._paused = 1
        self._write()

    def tick(self, *hook_args: Any) -> None:
        self._ticks += 1
        self._write()

    def rest(self, *hook_args: Any) -> None:
        """After the optimizer's step, in a compiled run (no forward beats): what follows until the next step
        (logging, validation, saving) is not watched, rather than watched blind."""
        self._ticks += 1
        self._paused = 1
        self._write()

    def on_save_checkpoint(self, loop: Any, checkpoint: dict) -> None:
        self._paused = 1
        self._write()

    def on_checkpoint_saved(self, loop: Any, path: Any) -> None:
        self._paused = 0
        self._write()

    def on_fit_end(self, loop: Any, result: dict) -> None:
        self.phase(END, "the end of the run (after its last step)")  # final writes, the test, the other ranks

    def _write(self) -> None:
        record = f"{self._pid} {self._step} {self._ticks} {self._paused} {self._steps} {self._phase} {self._label}"
        os.pwrite(self._fd, record.ljust(_WIDTH).encode(), 0)


def from_environment(rank: int) -> Any:
    """The heartbeat the launcher asked for in this worker's environment, or one that does nothing."""
    folder = os.environ.get(HEARTBEAT_DIR)
    return Heartbeat(Path(folder), rank) if folder and Path(folder).is_dir() else NoHeartbeat()


@dataclasses.dataclass
class _Rank:
    pid: int
    step: int
    ticks: int
    paused: bool
    steps: int  # the steps this process has started
    changed: float  # when the watch saw this record change (monotonic)
    phase: int = STEPS
    label: str = ""

    @property
    def point(self) -> tuple[int, int, int]:
        """How far it got: the later, the greater."""
        return self.phase, self.step, self.ticks

    @property
    def where(self) -> str:
        if self.phase != STEPS:
            return self.label or "its exit"
        return f"its first step (step {self.step + 1})" if self.steps == 1 else f"step {self.step + 1}"


def read_beats(folder: Path) -> dict[int, _Rank]:
    """Each rank's last record (its `changed` left at 0)."""
    beats = {}
    for path in folder.iterdir() if folder.is_dir() else ():
        if not path.name.isdigit():  # a rank's stack dump
            continue
        with contextlib.suppress(OSError, ValueError):
            fields = path.read_text().split(None, 6)
            pid, step, ticks, paused, steps, phase = map(int, (fields + [str(STEPS)])[:6])
            label = fields[6].strip() if len(fields) > 6 else ""
            beats[int(path.name)] = _Rank(pid, step, ticks, paused == 1, steps, 0.0, phase, label)
    return beats


def attach(beat: Any, loop: Any, compiled: bool) -> None:
    """Beat at each step of `loop`, after each forward pass of its task module (training and validation) and
    after each optimizer step, and pause around its saves. A compiled module gets no forward hook (a Python call
    inside it would break its graph, or fail with fullgraph=True): the watch then covers the steps alone."""
    loop.heartbeat = beat
    if isinstance(beat, Heartbeat):
        loop.callbacks.by_name["heartbeat"] = beat  # no state_dict: nothing of it goes into checkpoints
        register = getattr(loop.optimizer, "register_step_post_hook", None)  # a torch.optim.Optimizer's
        if register is not None:
            register(beat.rest if compiled else beat.tick)
        if not compiled:
            loop.task.register_forward_hook(beat.tick)


def log_path(run_dir: Path, rank: int) -> Path:
    """The rank's log, where the watch keeps its stacks: runner.log for rank 0, rank_<k>.log for the others."""
    return Path(run_dir) / ("runner.log" if rank == 0 else f"rank_{rank}.log")


class StallWatch:
    """A thread of the launcher that reads the beats. When an armed rank has been quiet for `timeout` seconds (or
    SLOWEST_PAUSE_FACTOR times the longest pause seen between its beats, if longer), it has every worker dump its
    stacks, keeps a message naming the least advanced rank with its stack, and kills the workers: the launcher
    then reports that message. The ranks are watched once each has beaten, from their start; the least advanced
    must itself have been quiet that long (a peer that waits for it may have been quiet longer). The longest pause
    counts from the second step (the first compiles, warms up). Ranks all quiet at the same point are not stuck on
    one another: that is said in the log, and the job goes on."""

    def __init__(self, folder: Path, num_processes: int, timeout: float, run_dir: Path, setting: str = "") -> None:
        self.folder, self.num_processes, self.timeout, self.run_dir = folder, num_processes, timeout, run_dir
        self.setting = setting or f"strategy.stall_timeout={timeout:g}"  # what chose the timeout, for the message
        self.rank: Optional[int] = None
        self.message: Optional[str] = None
        self.finished = False  # the stuck rank held a run that had finished: its results are whole
        self._ranks: dict[int, _Rank] = {}
        self._slowest = 0.0
        self._all_quiet_at: Optional[tuple[int, int]] = None  # where every rank was quiet, said once
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="runner-stall-watch", daemon=True)

    def __enter__(self) -> "StallWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def _watch(self) -> None:
        # A tenth of the timeout: the pauses the watch sees between beats stay below it while steps are fast.
        while not self._done.wait(min(1.0, self.timeout / 10)):
            stuck = self.check(time.monotonic())
            if stuck:
                self._end(stuck)
                self._forget_attempt()

    def _forget_attempt(self) -> None:
        """After the workers were killed: an attempt torchelastic restarts (trainer.max_restarts) is watched
        afresh, from its own records, and if it fails it is for what it says."""
        killed = bool(self._ranks)
        self._ranks.clear()
        for path in self.folder.iterdir():
            if path.name.isdigit():
                with contextlib.suppress(OSError):
                    path.unlink()
        while killed and not self._done.wait(0.2):
            if read_beats(self.folder):  # a new attempt's workers beat
                self.rank = self.message = None
                self.finished = False
                return

    def check(self, now: float) -> list[int]:
        """The ranks to blame if the job is stuck now, else []."""
        for rank, beat in read_beats(self.folder).items():
            seen = self._ranks.get(rank)
            if seen is None or seen.pid != beat.pid:
                self._ranks[rank] = dataclasses.replace(beat, changed=now)
            elif (beat.steps, beat.ticks, beat.paused, beat.phase) != (seen.steps, seen.ticks, seen.paused, seen.phase):
                if self._steady() and not seen.paused:
                    self._slowest = max(self._slowest, now - seen.changed)
                self._ranks[rank] = dataclasses.replace(beat, changed=now)
        if len(self._ranks) < self.num_processes:
            return []
        limit = max(self.timeout, SLOWEST_PAUSE_FACTOR * self._slowest)
        # A rank that finished and whose process has ended waits for no one: the furthest of all, never blamed.
        ended = {rank for rank, seen in self._ranks.items() if seen.phase == DONE and not running(seen.pid)}
        if ended:
            limit = min(limit, EXIT_GRACE_S)
        active = {rank: seen for rank, seen in self._ranks.items() if not seen.paused and rank not in ended}
        if not active:
            return []
        least = min(seen.point for seen in active.values())
        stuck = sorted(rank for rank, seen in active.items() if seen.point == least)
        if not all(now - active[rank].changed > limit for rank in stuck):
            return []
        if len(stuck) == self.num_processes:
            # A rank stopped by SIGSTOP (or Ctrl-Z) holds the others wherever it stopped, at their point too.
            stopped = [rank for rank in stuck if state(active[rank].pid) == "T"]
            if stopped:
                return stopped
            # Every rank quiet at the same point: none waits for another (a slow callback, upload or metric on
            # all of them, or a collective that hangs for all, which strategy.timeout ends). Said once, not ended.
            if self._all_quiet_at != least:
                self._all_quiet_at = least
                log.warning("every rank has been quiet for %.0f s at the same point of %s (%s): none waits "
                            "for another, so the job goes on; a collective that never completes ends at "
                            "strategy.timeout", now - min(seen.changed for seen in active.values()),
                            active[stuck[0]].where, self.setting)
            return []
        return stuck

    def _steady(self) -> bool:
        """Past every rank's first step: the pauses between beats are those of training."""
        return len(self._ranks) == self.num_processes and all(seen.steps >= 2 for seen in self._ranks.values())

    def _end(self, stuck: list[int]) -> None:
        quiet = time.monotonic() - min(self._ranks[rank].changed for rank in stuck)
        stopped = {rank for rank, seen in self._ranks.items() if state(seen.pid) in ("T", "t")}  # cannot dump
        stacks = dump_stacks({rank: seen.pid for rank, seen in self._ranks.items()
                              if running(seen.pid) and rank not in stopped}, self.folder)
        kept = keep_in_logs(stacks, self.run_dir)
        first = self._ranks[stuck[0]]
        others = ("after the other ranks had ended" if any(seen.phase == DONE and not running(seen.pid)
                                                           for seen in self._ranks.values())
                  else "while the other ranks waited for it")
        who = (f"rank {stuck[0]} made no progress for {quiet:.0f} s in {first.where}, {others}" if len(stuck) == 1
               else f"ranks {', '.join(map(str, stuck))} made no progress for {quiet:.0f} s in {first.where}, all at "
                    "the same point of it")
        if stopped & set(stuck):
            who += (f"; {'it is' if len(stuck) == 1 else 'rank ' + ', '.join(map(str, sorted(stopped & set(stuck))))}"
                    " stopped (SIGSTOP, or Ctrl-Z; SIGCONT would resume it)")
        # Rank 0 wrote everything the run keeps (checkpoints, metrics.json, the loggers) before it reached DONE.
        self.finished = self._ranks.get(0) is not None and self._ranks[0].phase == DONE
        ended = "the job was ended"
        if self.finished:
            ended += ": the run had finished, its checkpoints and metrics.json are whole"
        elif (first.phase != STEPS or first.steps == 1) and not stopped & set(stuck):  # a slow start is legitimate
            ended += "; if it is only slow (a download, compiling), raise strategy.stall_timeout"
        shown = "\n".join(f"rank {rank}'s Python stack (most recent call first):\n"
                          f"{_top(stacks.get(rank, ''), stopped=rank in stopped)}" for rank in stuck)
        self.rank = stuck[0]
        self.message = f"{who} ({self.setting}); {ended}.\n{shown}"
        if kept:
            self.message += f"\nevery rank's stacks are in its log ({', '.join(kept)})"
        for seen in self._ranks.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(seen.pid, signal.SIGKILL)


def dump_stacks(pids: dict[int, int], folder: Path, wait: float = 5.0) -> dict[int, str]:
    """Have each worker write its Python stacks to `<folder>/<rank>.stack` (faulthandler, on DUMP_SIGNAL) and
    return them, once they stop growing (or after `wait` seconds)."""
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, DUMP_SIGNAL)
    stacks: dict[int, str] = {}
    deadline = time.monotonic() + wait
    while len(stacks) < len(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
        for rank in set(pids) - set(stacks):
            text = _read(folder / f"{rank}.stack")
            time.sleep(0.05)  # a dump still being written has grown by then
            if text.strip() and text == _read(folder / f"{rank}.stack"):
                stacks[rank] = text.strip()
    return stacks


def keep_in_logs(stacks: dict[int, str], run_dir: Path) -> list[str]:
    """Append each rank's dump to its log, where it outlives the launch's private folder; the logs written."""
    kept = []
    for rank, stack in sorted(stacks.items()):
        path = log_path(run_dir, rank)
        if path.exists():  # a job whose logging writes no runner.log or rank_<k>.log gets none made for this
            flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC  # never through a planted link
            with contextlib.suppress(OSError), open(os.open(path, flags), "a") as log:
                log.write(f"Python stacks of rank {rank}, dumped when the job was found stalled:\n{stack}\n")
                kept.append(path.name)
    return kept


def _top(stack: str, lines: int = 15, stopped: bool = False) -> str:
    """The innermost frames of a dump, where a stall is; the whole dump goes to the rank's log."""
    if not stack:
        return "(it is stopped: it cannot write one)" if stopped else "(it wrote none in time)"
    kept = stack.splitlines()[:lines + 1]
    return "\n".join(kept) + ("\n  ..." if len(stack.splitlines()) > len(kept) else "")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def dump_stacks_on_signal(rank: int) -> Any:
    """In a launched worker: on DUMP_SIGNAL, write every thread's Python stack to `<beats folder>/<rank>.stack`,
    even while the main thread is blocked (faulthandler writes from the signal handler). Returns the open file,
    to keep open while the worker runs; None when no launcher watches."""
    import faulthandler

    folder = os.environ.get(HEARTBEAT_DIR)
    if not folder or not Path(folder).is_dir():
        return None
    file = open(Path(folder) / f"{rank}.stack", "w")  # noqa: SIM115 - faulthandler writes to it until the end
    faulthandler.register(DUMP_SIGNAL, file=file, all_threads=True)
    return file
