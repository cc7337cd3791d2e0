"""The errors that end a job with a message that says it all, and how to tell them from a bug.

A user error (bad config, a refused checkpoint, a stopped job, a failed worker's own report, ...) is printed as one
message; anything else keeps its traceback, as a bug to report.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import sysconfig
import time
import traceback
from pathlib import Path
from typing import Any, Callable


class JobStopped(RuntimeError):
    """The job was asked to stop by a signal; its workers saved last.ckpt at a step boundary and exited."""

    def __init__(self, signum: int, run_dir: Path) -> None:
        self.signum = signum
        super().__init__(stop_message(signum, run_dir))


def stop_message(signum: int, run_dir: Path) -> str:
    """What a stopped job tells its user: the signal, the step it saved, and how to continue (if it can)."""
    name = signal.Signals(signum).name if signum else "a signal"
    last = run_dir / "checkpoints" / "last.ckpt"
    metrics = _metrics(run_dir)
    stage = metrics.get("stopped_in", "") if metrics.get("stop_signal") else ""
    if stage.startswith("stage="):  # validate, test or predict: nothing to resume, nothing written
        product = "predictions.pt" if stage == "stage=predict" else "metrics"
        return f"stopped by {name} during {stage} before its end: it wrote no {product}; run it again"
    if not last.exists():
        return f"stopped by {name} before the first checkpoint: nothing was saved, start the run again"
    # A stopped run's metrics.json is written after its last.ckpt, at the same step: no checkpoint to read.
    if not metrics.get("stop_signal"):
        return f"stopped by {name}; resume with trainer.ckpt_path={last}"
    if metrics.get("stopped_in") == "test after training":  # the training is whole and saved; its test is not
        tested = last if metrics.get("tested") == "last" else metrics.get("tested")
        return (f"stopped by {name} during the test after training (training ended at step {metrics['step']}, "
                f"saved in {last}); no test metrics: test with stage=test trainer.ckpt_path={tested}")
    return f"stopped by {name} at step {metrics['step']}, saved in {last}; resume with trainer.ckpt_path={last}"


def _metrics(run_dir: Path) -> dict:
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}
    return metrics if isinstance(metrics, dict) else {}


class NonFiniteLossError(RuntimeError):
    """The loss or the weights became NaN or infinite (trainer.skip_nonfinite_loss skips such steps instead)."""


class DataError(RuntimeError):
    """The data broke what the global order rests on, found as it is read: a len() that is not what the data
    yields, processes whose streams differ, an epoch with nothing in it, a state that is not plain data."""


class CallbackError(ValueError):
    """A callback's setting that only a running job can check (a monitored metric nobody logs)."""


class HookFailed(RuntimeError):
    """User code (a data module's prepare_data or setup, a callback's hook, a data set's samples) raised or exited:
    the message names what failed and what it did (`what`, where the default does not say it); the traceback goes
    to the run's log files, not the console."""

    def __init__(self, hook: str, error: BaseException, where: str = "", what: str = "") -> None:
        what = what or (f"exited ({error!r})" if isinstance(error, SystemExit) else f"raised {error_line(error)}")
        super().__init__(f"{hook} {what}{f' {where}' if where else ''}")
        self.__cause__ = error
        _to_log_files(self)


def error_line(error: BaseException) -> str:
    """`Type: first line of the message`; for an error a DataLoader worker raised, the worker's own (torch re-raises
    it in the main process as "Caught Type in DataLoader worker process k", the original traceback in its text)."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Caught ") and lines[1].startswith("Original Traceback"):
        name, where = lines[0].split()[1], lines[0].split(" in ", 1)[-1].rstrip(".")
        own = [line for line in lines[2:] if line == name or line.startswith(f"{name}:")]  # the traceback's last
        return f"{(own or lines)[-1].strip()} (in {where.replace('DataLoader worker process', 'loader worker')})"
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def call_hook(hook: str, call: Callable[[], Any], where: str = "") -> Any:
    """`call()`, where a raise or an exit (a library helper's sys.exit) is a HookFailed naming `hook`."""
    try:
        return call()
    except (Exception, SystemExit) as error:  # noqa: BLE001 - any failure of user code is that hook's
        raise HookFailed(hook, error, where) from error


def say(message: str) -> None:
    """`error: <message>` on the console: how the command line ends a job it refuses or that failed. Where torchelastic
    started this process (torchrun), the message also goes to the error file it reads, so that its report of the
    failed rank shows it rather than '<N/A>' and a link to its docs."""
    print(f"error: {message}", file=sys.stderr)
    report_to_launcher(message)


def report_to_launcher(message: str, name: str = "Error") -> None:
    """`message` in torchelastic's error file for this process (TORCHELASTIC_ERROR_FILE, set by torchrun and by the
    runner's launcher): the launcher shows it as this rank's failure, without a traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        detail = {"message": f"{name}: {message}",
                  "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
        Path(path).write_text(json.dumps({"message": detail}))


def _to_log_files(error: BaseException) -> None:
    """`error` with its cause's traceback in the runner's log files (the console gets the one line)."""
    log, cause = logging.getLogger("runner"), error.__cause__ or error
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (error,),
                            (type(cause), cause, cause.__traceback__))
    logger: Any = log
    while logger is not None:  # the runner's own files, or Hydra's runner.log where the runner's logger propagates
        for handler in logger.handlers:
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)
        logger = logger.parent if logger.propagate else None


def constructor_failure(error: BaseException) -> BaseException:
    """A failed `instantiate` (Hydra's "Error in call to target '...': ... full_key: ...") as what the constructor
    said: the runner's own refusal alone (a ConfigError, or a runner class's ValueError, whose words name the key);
    for any other class, one line naming its key and `_target_` with the error, the traceback in the run's log.
    Anything else is returned as it is."""
    from hydra.errors import InstantiationException

    from runner.config import ConfigError

    cause = error.__cause__
    if not isinstance(error, InstantiationException) or cause is None:
        return error
    if isinstance(cause, ConfigError):
        return cause
    target = re.search(r"Error in call to target '([^']+)'", str(error))
    key = re.search(r"full_key: (\S+)", str(error))
    name = target.group(1) if target else "?"
    if name.startswith("runner.") and isinstance(cause, ValueError):
        return ConfigError([error_line(cause).partition(": ")[2]])
    return HookFailed(f"{key.group(1) if key else 'the object'} ({name})", cause)


class UserCodeFailed(RuntimeError):
    """An error raised in the user's own code (a model's forward, a loss, a helper of theirs) that the runner did not
    expect: the user's frames and the error, in Python's form; the runner's frames, with the whole traceback, go to
    the run's log (`log` names it)."""

    def __init__(self, error: BaseException, frames: list, log: str) -> None:
        shown = "".join(traceback.format_list(frames)).rstrip()
        lines = str(error).strip().splitlines()
        super().__init__(f"{type(error).__name__} in your code (the runner's frames are in {log}):\n{shown}\n"
                         f"{type(error).__name__}: {lines[0] if lines else ''}")
        self.__cause__ = error
        _to_log_files(self)


_RUNNER_DIR = os.path.dirname(os.path.abspath(__file__))
_LIBRARY_DIRS = tuple(dict.fromkeys(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")))


def _whose(filename: str) -> str:
    """'runner', 'library' (the standard library, installed packages, frozen modules) or 'user' for a frame's file."""
    path = os.path.abspath(filename)
    if filename.startswith("<") or {"site-packages", "dist-packages"} & set(path.split(os.sep)) or any(
            path.startswith(folder + os.sep) for folder in _LIBRARY_DIRS):
        return "library"
    return "runner" if path.startswith(_RUNNER_DIR + os.sep) else "user"


def user_code_failure(error: BaseException, log: str = "the run's log") -> BaseException:
    """`error` as a UserCodeFailed when it was raised in the user's code: the innermost frame that is not a
    library's (torch, the standard library) is the user's. Anything else is returned as it is (a bug to report)."""
    if is_user_error(error):
        return error
    frames = traceback.extract_tb(error.__traceback__)
    innermost = next((_whose(f.filename) for f in reversed(frames) if _whose(f.filename) != "library"), None)
    if innermost != "user":
        return error
    return UserCodeFailed(error, [f for f in frames if _whose(f.filename) == "user"], log)


class PeerLost(RuntimeError):
    """Under torchrun or srun, another process of the job went away under a collective (its node lost, or killed):
    each surviving rank says so in one line, the transport's traceback in its log file. Its message keeps the
    transport's words, so that it still reads as a consequence (runner.processes.peer_gone)."""

    def __init__(self, rank: int, error: BaseException, run_dir: Path) -> None:
        said = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0] if str(error).strip() else "")
        said = said.split(". ")[0].rstrip(".")
        last = run_dir / "checkpoints" / "last.ckpt"
        then = f"resume with trainer.ckpt_path={last}" if last.exists() else f"no checkpoint in {run_dir} yet"
        super().__init__(f"rank {rank}: another process of the job went away ({said}): a node or a rank was lost, "
                         f"and its own log or launcher says why; {then}")
        self.__cause__ = error
        _to_log_files(self)


class WorkerFailed(RuntimeError):
    """A worker of the job raised or died; the message names the rank and carries its traceback."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        super().__init__(message)


def is_user_error(error: BaseException) -> bool:
    """Errors whose message says it all; anything else keeps its traceback (it is a bug to report)."""
    from hydra.errors import InstantiationException

    from runner.checkpoint_io import CheckpointError
    from runner.config import ConfigError
    from runner.run_lock import RunFolderBusy
    from runner.tasks import BatchError

    known = (ConfigError, WorkerFailed, HookFailed, PeerLost, CheckpointError, NonFiniteLossError, JobStopped,
             InstantiationException, BatchError, CallbackError, RunFolderBusy, UserCodeFailed, DataError)
    return isinstance(error, known)
