"""The command line: `python -m runner [overrides]` through Hydra; each job validates, then trains or launches."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn, Optional

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner import collector
from runner.checks.keys import check_overrides
from runner.completion import PYTHON_M_BASH, normalize_query_line, run_as_python_m, wants_bash_install
from runner.composition import forget_said_lines, register_configs
from runner.config import CONFIG_DIR, CONFIG_MODULE, ConfigError, register_resolvers
from runner.hydra_hooks import (composed_once, linked_log_in_one_line, unknown_options_in_one_line,
                                write_hydra_records_whole, wrong_types_in_one_line)
from runner.launch import ElasticLauncher

register_resolvers()
register_configs()
write_hydra_records_whole()

# Jobs of this process that failed; a sweep goes on after a failure and exits non-zero at the end.
failed_jobs: list[str] = []
# Jobs this command started (the folders): when a launcher's workers trained every one of them, nothing in this process
# needs the interpreter's teardown of the modules at its exit.
started_jobs: list[str] = []
_main_pid: Optional[int] = None


def _external_environment() -> Any:
    """torchrun's or SLURM's environment when one of them started this process, else None."""
    from runner.environments import SLURMEnvironment, TorchElasticEnvironment

    return next((e() for e in (TorchElasticEnvironment, SLURMEnvironment) if e.detect()), None)


_REFUSED_SWEEP = ("a sweep (-m) cannot run in processes {launcher} started: each of its jobs starts its own "
                  "workers. Run it without {launcher}: python -m runner -m ... strategy=ddp trainer.devices=N "
                  "(or hydra/launcher=submitit_slurm for jobs on a SLURM cluster)")


def _launcher_name(environment: Any) -> str:
    from runner.environments import SLURMEnvironment

    return "srun" if isinstance(environment, SLURMEnvironment) else "torchrun"


def _prepare_external_launch(argv: list[str]) -> list[str]:
    """Overrides for processes torchrun or srun started, so that all ranks of a job share one run folder.

    Under SLURM the folder is named after the job, so a requeued job finds its own checkpoints. Ranks > 0
    compose the same config but write nothing: their Hydra run dir is the system's temporary folder, which
    exists already (so no folder is made, nor left behind by a killed run), with no .hydra/ output and no
    logging set up by Hydra; rank 0's run folder is broadcast to them once the process group is up.
    """
    from runner.environments import SLURMEnvironment

    if any(a in ("--help", "-h", "--info", "--cfg", "-c") for a in argv):
        return argv
    environment = _external_environment()
    if environment is None:
        return argv
    if any(a in ("-m", "--multirun") for a in argv):
        _report(ConfigError([_REFUSED_SWEEP.format(launcher=_launcher_name(environment))]))
        sys.exit(1)
    if isinstance(environment, SLURMEnvironment):
        job = f"{os.environ.get('SLURM_JOB_ID', '0')}-{os.environ.get('SLURM_STEP_ID', '0')}"
        if not any(a.startswith("hydra.run.dir=") for a in argv):
            argv = [*argv, f"hydra.run.dir=outputs/slurm-{job}"]
    if environment.global_rank() == 0:
        return argv
    return [*argv, f"hydra.run.dir={tempfile.gettempdir()}", "hydra.output_subdir=null",
            "hydra/job_logging=none", "hydra/hydra_logging=none"]


_CHECK_STAGES = ("stage=check", "stage=check_data")


def _multirun(argv: list[str]) -> bool:
    return any(a in ("-m", "--multirun") for a in argv)


def _prepare_check(argv: list[str]) -> list[str]:
    """`stage=check` runs one job whatever the experiment says (lr_sweep's hydra.mode=MULTIRUN is checked as one
    config, not launched), and without -m writes no run folder: its Hydra folder is the system's temporary one (it
    exists already), with no .hydra/ and logging to the console only. Settings the user typed are kept."""
    if not _checking(argv) or any(a in ("--help", "-h", "--info", "--cfg", "-c") for a in argv):
        return argv
    if _multirun(argv):
        return argv  # Hydra's sweep: each job is checked in this process (runner.sweep writes the summary)
    typed = {a.split("=", 1)[0].lstrip("+~") for a in argv}
    extra = ["hydra.mode=RUN"]
    if "hydra.run.dir" not in typed:
        extra += [f"hydra.run.dir={tempfile.gettempdir()}", "hydra.output_subdir=null"]
    if "hydra/job_logging" not in typed:
        extra.append("hydra/job_logging=stdout")
    return [*argv, *extra]


def _check_run_dir(job_dir: Path) -> Optional[Path]:
    """The run folder a check finds `trainer.ckpt_path=last|best` from: the user's hydra.run.dir, or none."""
    return None if job_dir.resolve() == Path(tempfile.gettempdir()).resolve() else job_dir


_NUMBER = re.compile(r"[+-]?\d+(\.\d+)?")


def _quote_numeric_choices(argv: list[str]) -> list[str]:
    """`precision=16` reaches Hydra as an int and fails with a traceback; quoted, Hydra lists the options."""
    groups = {p.name for p in Path(CONFIG_DIR).iterdir() if p.is_dir()}
    quoted = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") in groups:
            value = ",".join(f"'{v}'" if _NUMBER.fullmatch(v) else v for v in value.split(","))
        quoted.append(f"{key}{sep}{value}")
    return quoted


def _report(error: BaseException) -> None:
    from runner.errors import say

    say(str(error))


class RunFolders(Callback):
    """A run or sweep folder Hydra cannot create (a read-only file system, a file in its path) is one line,
    said before Hydra's own mkdir fails with a traceback."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.get("stage") in ("check", "check_data"):
            return  # a check writes nothing in its folder, and takes none from a run
        _check_folder(config.hydra.run.dir, "hydra.run.dir")
        _take_run_folder(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        collector.resume()  # a sweep's driver runs for hours, its jobs in other processes too (runner.collector)
        _check_folder(config.hydra.sweep.dir, "hydra.sweep.dir")
        record = Path(config.hydra.sweep.dir, "multirun.yaml")
        if record.is_symlink():  # Hydra's sweeper writes it next with open(), which would follow the link
            record.unlink()


def _check_folder(folder: str, key: str) -> None:
    path = Path(folder).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        reason = f"{existing} is a file, not a folder"
    elif not os.access(existing, os.W_OK | os.X_OK):
        reason = f"{existing} is not writable (a read-only file system, or another user's folder)"
    else:
        reason = _write_problem(path)
        if reason is None:
            return
    _report(ConfigError([f"{key}={folder} cannot be created or written: {reason}"]))
    raise SystemExit(1)


# What a start writes before the first checkpoint (.hydra/, logs): a folder that cannot take this is full.
_PROBE_BYTES = 64 * 1024


def _write_problem(path: Path) -> Optional[str]:
    """Why `path` cannot take files (a full disk, a quota), found by creating it as Hydra would and writing an
    unnamed file there; None when it can. A folder this made is removed again when it fails."""
    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as probe:
            probe.write(bytes(_PROBE_BYTES))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        for folder in made:  # innermost first; only the empty folders made here
            with contextlib.suppress(OSError):
                folder.rmdir()
        return write_error_reason(path, error)
    return None


def write_error_reason(path: Path, error: OSError) -> str:
    """What an OSError from writing in `path` means, in the words of the fix (Hydra's own names no folder)."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"no space left in {path} ({os.strerror(error.errno)}): free some space there, or choose a folder "
                "on another disk")
    if error.errno == errno.EROFS:
        return f"{path} is on a read-only file system"
    return f"{os.strerror(error.errno) if error.errno else error} in {path}"


def _take_run_folder(folder: str) -> None:
    """A second run in a live run's folder is refused before Hydra writes its files there (runner.run_lock)."""
    from runner import run_lock

    environment = _external_environment()
    if environment is not None and environment.global_rank() != 0:
        return  # a rank > 0 of torchrun or srun: its Hydra folder is the system's temporary one
    try:
        run_lock.acquire(Path(folder))
    except (run_lock.RunFolderBusy, ConfigError) as refused:  # a live run there, or a `.hydra` that is a link
        _report(refused)
        raise SystemExit(1) from None


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
def hydra_main(cfg: DictConfig) -> Optional[float]:
    """One Hydra job. Returns its score by the objective (`cfg.objective`: the best over the run's validations,
    where the run records it) so sweeper plugins can optimise it."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from runner import job, sweep
    from runner.errors import stop_message
    from runner.composition import said_lines
    from runner.logs import chosen_job_logging, write_to_log_files

    write_to_log_files(said_lines())  # said while composing, before this job's runner.log was open
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    started_jobs.append(str(job_dir))
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    environment = _external_environment() if multirun and os.getpid() == _main_pid else None
    if environment is not None:  # a preset's hydra.mode=MULTIRUN (a launcher plugin's job runs elsewhere)
        _report(ConfigError([_REFUSED_SWEEP.format(launcher=_launcher_name(environment))]))
        sys.exit(1)
    fit = functools.partial(job.fit, own_logging=False, job_logging=chosen_job_logging(hydra_cfg))
    checking = cfg.get("stage") in ("check", "check_data")
    if checking and not multirun:
        job_dir = _check_run_dir(job_dir)
    try:
        metrics = sweep.run_job(cfg, job_dir, Path(hydra_cfg.sweep.dir), fit) if multirun else fit(cfg, job_dir)
    except Exception as error:  # noqa: BLE001 - a known failure becomes one message and a non-zero exit
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        error = _in_user_code(error, job_dir)
        if not _expected(error):
            raise
        _report(error)
        if not multirun:
            sys.exit(128 + error.signum if hasattr(error, "signum") else 1)
        if os.getpid() != _main_pid:  # a parallel launcher's worker: let the launcher see the failure
            raise
        if hasattr(error, "signum"):  # JobStopped: a signal stops the whole sweep, not this job alone
            _end_stopped_sweep(error.signum, job_dir)
        failed_jobs.append(str(job_dir))
        return None
    if metrics.get("stop_signal"):  # unfinished, to resume (a callback's stop is a finished run)
        signum = metrics["stop_signal"]
        external = _external_environment()
        if external is None or external.global_rank() == 0:  # other ranks' Hydra folders hold no checkpoint
            print(f"error: {stop_message(signum, job_dir)}", file=sys.stderr)
        if not multirun:
            sys.exit(128 + signum)
        _end_stopped_sweep(signum, job_dir)
    if checking:
        return None
    if multirun and cfg.objective not in metrics:
        known = ", ".join(k for k, v in metrics.items() if isinstance(v, float))
        print(f"warning: objective={cfg.objective} is not a metric of job {job_dir.name} ({known}); "
              "the sweeper gets no value for it", file=sys.stderr)
    return sweep.objective_value(metrics, cfg.objective)  # the best over the run's validations, where recorded


def _end_stopped_sweep(signum: int, job_dir: Path) -> None:
    """A stop signal ends the sweep: the jobs after this one do not start (Hydra's launcher runs no more)."""
    print(f"error: the sweep stopped at job {job_dir.name}; the same command again skips the finished jobs and "
          "resumes this one", file=sys.stderr)
    sys.exit(128 + signum if signum else 1)


def _in_user_code(error: BaseException, job_dir: Optional[Path]) -> BaseException:
    """An error the user's own code raised (a model's forward): its frames and the error, the rest in runner.log."""
    from runner.errors import user_code_failure

    log = job_dir / "runner.log" if job_dir is not None and (job_dir / "runner.log").exists() else "the run's log"
    return user_code_failure(error, str(log))


def _expected(error: BaseException) -> bool:
    from runner.errors import is_user_error

    return is_user_error(error)


def main(program: bool = False) -> None:
    """The command line (`python -m runner`, the `runner` script: runner.__main__). `program`: this process is the
    command itself, where nothing runs after main(); a program or a test that calls main() is not."""
    global _main_pid
    _main_pid = os.getpid()
    failed_jobs.clear()  # this command's sweep only (a program may call main() more than once)
    started_jobs.clear()
    launches = ElasticLauncher.launches
    forget_said_lines()  # and its own lines about the user's config files
    if run_as_python_m() and wants_bash_install(sys.argv[1:]):
        print(PYTHON_M_BASH)  # Hydra's own completes `runner ...`, not `python -m runner ...`
        return
    normalize_query_line()
    # `runner` imports experiment code from the current folder, as `python -m runner` does.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    problems = check_overrides(sys.argv[1:], CONFIG_DIR)
    if problems:
        _report(ConfigError(problems))
        sys.exit(1)
    sys.argv[1:] = _prepare_check(_prepare_external_launch(_quote_numeric_choices(sys.argv[1:])))
    composing = composed_once() if not _multirun(sys.argv[1:]) else contextlib.nullcontext()
    try:
        with wrong_types_in_one_line(), unknown_options_in_one_line(), linked_log_in_one_line(), composing:
            hydra_main()
    except KeyboardInterrupt:  # a second Ctrl-C (the first asks for a stop at a step), or one during start-up
        print("error: interrupted by Ctrl-C: ended at once, nothing saved after the last checkpoint", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    finally:
        from runner import run_lock

        run_lock.release_all()  # the run folder this process took before Hydra wrote in it (in-process callers)
    code = 0
    if failed_jobs:
        print(f"error: {len(failed_jobs)} job(s) failed: {', '.join(failed_jobs)}", file=sys.stderr)
        code = 1
    launched_all = bool(started_jobs) and ElasticLauncher.launches - launches == len(started_jobs)
    if (_checking(sys.argv[1:]) or launched_all) and program:
        _exit_skipping_teardown(code)
    if code:
        sys.exit(code)


def _checking(argv: list[str]) -> bool:
    return any(a.lstrip("+") in _CHECK_STAGES for a in argv)


def _exit_skipping_teardown(code: int) -> NoReturn:
    """End a finished check, or a command whose every job trained in launched workers, as the interpreter would, less
    its teardown of the modules: torch's takes ~0.4 s of CPU, a seventh of `python -m runner stage=check`, 0.5-1.2 s
    of the launcher's exit after its workers ended, and neither leaves anything for it (the workers have ended and
    written the run; a check writes nothing).

    The exit handlers run first (atexit: logging's flush and close, weakref finalizers such as a temporary
    folder's), then the console is flushed. Where a thread of the user's code still runs, the interpreter's own
    exit waits for it, as always."""
    import atexit
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a console already closed
            stream.flush()
    os._exit(code)
