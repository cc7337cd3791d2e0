"""One training process: build the components from a resolved config, train, tear down.

Runs in the Hydra process itself for one device (or under torchrun/srun), and as the entry point of each
process the launcher starts. It never re-enters `@hydra.main`, so a worker never sees a sweep's arguments.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from runner import collector, heartbeat
from runner import build
from runner import stages
from runner.checkpoint_io.model_record import record_model
from runner.data import STAGE_SPLITS, TrainBatches, close_loaders, train_loader, val_loader
from runner.config import import_target, targets
from runner.data.loaders import worker_died
from runner.environments import SLURMEnvironment
from runner.lightning import is_lightning_config
from runner.lightning.detect import is_lightning_module
from runner.lightning.trainer_view import TrainerView
from runner.lightning.attach import attach as attach_lightning, setup_module
from runner.logs import NoFollowFileHandler, apply_job_logging
from runner.processes import FOLLOWS_ANOTHER, SAME_REQUEST_S, STOP_SIGNALS, alive, peer_gone, threads_per_process
from runner.loggers.tracking import flatten
from runner.loop import Loop, make_schedule
from runner.loop.progress import CompileLines, loader_length
from runner.loop.stop import ReadCut
from runner.tasks import TaskModule

log = logging.getLogger("runner")


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.are_deterministic_algorithms_enabled() != deterministic:
        # Only when it changes: the call imports torch._inductor, about 0.7 s of start-up per process.
        torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = deterministic


# How long a stop signal waits for a read of the training data to finish (a slow batch) before it cuts the read.
READ_WAIT_S = 5.0
# How long a rank that failed only because another did waits before it exits, so that the other reports first.
CONSEQUENCE_WAIT_S = 2.0


def _said_beside(message: str, *args: Any) -> None:
    """`log.warning(message, *args)` for a signal handler. The handler runs between two steps of the main thread,
    which may be inside a write of a log line (a pipe to the launcher that is full): a line written from there
    re-enters that stream ('reentrant call inside BufferedWriter', a logging error and its traceback on the console).
    Another thread writes it, after the handlers' lock that such a write holds; the handler waits for it a moment,
    so that its line comes first wherever nothing is being written."""
    writer = threading.Thread(target=log.warning, args=(message, *args), name="runner-signal-line", daemon=True)
    writer.start()
    writer.join(timeout=0.5)


class StopRequest:
    """Set by SIGTERM/SIGINT/SIGHUP; the loop stops at the next step where the processes agree, after a checkpoint.


    While the loop waits for its training data (`reading`), a signal may never reach a step: a stream that blocks,
    or data that never comes. Once it has waited READ_WAIT_S seconds after the signal, the read is cut
    (ReadCut, raised in the loop's thread) and the loop stops where it stands. Once the run has `finished`, such a
    signal has nothing left to stop: it is said, and the process ends as it would have (a signal after the run is no
    error).
    """

    def __init__(self) -> None:
        self.signal = 0
        self._since = 0.0
        self.finished = False
        self._reads = 0  # reads begun: a timer cuts only the read it was started in
        self._in_read = False
        self._cut = False
        self._reading = _Reading(self)

    def __call__(self) -> int:
        return self.signal

    def reading(self) -> "_Reading":
        """A context for one read of the training data, during which a stop signal is not left waiting."""
        return self._reading

    def _handle(self, signum: int, frame: Any) -> None:
        if self._cut and self._in_read:  # the timer's call, in the main thread: end the read now
            self._cut = False
            raise ReadCut(self.signal)
        if self.finished:
            _said_beside("received %s after the run had finished: nothing left to stop", signal.Signals(signum).name)
            return
        if self.signal:
            if signum == signal.SIGINT and time.monotonic() - self._since >= SAME_REQUEST_S:
                raise KeyboardInterrupt  # Ctrl-C twice: stop now, without a checkpoint
            return  # a repeated SIGTERM/SIGUSR1 (several senders, or a re-sent notice) changes nothing
        self.signal, self._since = signum, time.monotonic()
        _said_beside("received %s: stopping after this step or the next (once every process knows), after saving "
                     "last.ckpt", signal.Signals(signum).name)
        if self._in_read:
            self._watch_read()

    def _watch_read(self) -> None:
        read = self._reads
        timer = threading.Timer(READ_WAIT_S, self._cut_read, args=(read,))
        timer.daemon = True
        timer.start()

    def _cut_read(self, read: int) -> None:
        if self._in_read and self._reads == read:
            self._cut = True
            # A real signal to the main thread: it ends the system call the read waits in (interrupt_main would not).
            signal.pthread_kill(threading.main_thread().ident, self.signal)

    @contextlib.contextmanager
    def installed(self, signals: tuple = STOP_SIGNALS, kept_when_finished: bool = False) -> Iterator["StopRequest"]:
        """The handler for `signals` while the block runs; `kept_when_finished`: left in place once the run has
        finished (a launched worker, whose teardown and exit follow)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in signals}
        try:
            yield self
        finally:
            if not (kept_when_finished and self.finished):
                for sig, handler in previous.items():
                    signal.signal(sig, handler)


class _Reading:
    """One read of the training data (cheap to enter: the loop enters it every step)."""

    def __init__(self, request: StopRequest) -> None:
        self.request = request

    def __enter__(self) -> None:
        request = self.request
        request._reads += 1
        request._in_read, request._cut = True, False
        if request.signal:  # the signal came before this read: it may be the one that never ends
            request._watch_read()

    def __exit__(self, *exc: Any) -> None:
        self.request._in_read = False


def configure_logging(run_dir: Path, rank: int) -> None:
    """runner.log for rank 0, rank_<k>.log for the others; only rank 0 talks on the console below warnings."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if apply_job_logging(run_dir, rank):  # the job chose a hydra/job_logging of its own
        return
    name = "runner.log" if rank == 0 else f"rank_{rank}.log"
    file_handler = NoFollowFileHandler(run_dir / name)  # a link planted at its path is refused, not followed
    file_handler.setFormatter(logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] - %(message)s"))
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] - %(message)s"))
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # The runner's own logger only: a program calling runner.fit() keeps its logging set-up.
    for old in log.handlers:
        old.close()
    log.handlers = [file_handler, console]
    log.setLevel(logging.INFO)
    log.propagate = False


def run(cfg: Any, run_dir: Any, ckpt_path: Any = None, own_logging: bool = True, strategy: Any = None,
        launched: bool = False) -> dict:
    """Train one process's share of the job described by the resolved `cfg` (with `strategy` if built already).
    `launched`: a process the runner's launcher started, which ends once this returns."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
    strategy = strategy or build.build_strategy(cfg)
    threads = torch.get_num_threads()  # a program calling runner.fit() gets its own setting back
    # The processes that share this one's CPUs: torchrun's and the launcher's workers are told how many; an srun
    # task has its cpus-per-task to itself.
    _set_threads(threads_per_process(cfg.trainer.get("num_threads", "auto"),
                                     int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    strategy.setup_environment()
    try:
        # Under torchrun every rank ran Hydra on its own; rank 0's run folder and checkpoint are the job's.
        run_dir, ckpt_path = strategy.broadcast((str(run_dir), ckpt_path))
        run_dir = Path(run_dir)
        if own_logging or strategy.global_rank != 0:
            configure_logging(run_dir, strategy.global_rank)
        _check_same_config(cfg, strategy)
        if strategy.is_global_zero:
            remove_stale_temporaries(run_dir)
        slurm = SLURMEnvironment.detect()
        # SLURM sends SIGUSR1 ahead of the time limit (sbatch --signal=USR1@90): checkpoint, then requeue.
        with StopRequest().installed(STOP_SIGNALS + ((signal.SIGUSR1,) if slurm else ()), launched) as stop:
            result = _in_one_line(lambda: _train(cfg, strategy, run_dir, ckpt_path, stop), strategy, run_dir,
                                  cfg.data.get("num_workers", "the loaders' own"))
            stop.finished = True
            if result.get("stop_signal") == signal.SIGUSR1 and strategy.is_global_zero:
                _requeue_slurm_job()
            return result
    finally:
        # The loop's reference cycles keep DDP alive, and DDP the process group: free them now, while the
        # interpreter is whole. Freed during its shutdown, gloo's threads abort the process (SIGABRT).
        gc.collect()
        strategy.teardown()
        _set_threads(threads)


def _set_threads(count: int) -> None:
    if torch.get_num_threads() != count:  # a forked worker inherited its parent's pool
        torch.set_num_threads(count)


def _in_one_line(train: Any, strategy: Any, run_dir: Path, workers: Any) -> dict:
    """`train()`, where a peer lost under torchrun or srun (a node gone) is a PeerLost for this rank: one line, not
    Hydra's report of the transport's traceback (the runner's own launcher tells a consequence from a cause itself);
    and a loader worker's death, which torch raises wherever the process is, is one line naming it."""
    from runner.errors import PeerLost

    try:
        return train()
    except Exception as error:
        environment = getattr(strategy, "cluster_environment", None)
        if peer_gone(error) and getattr(environment, "creates_processes_externally", False):
            raise PeerLost(strategy.global_rank, error, run_dir) from error
        from runner.errors import is_user_error

        # One torch raised from its SIGCHLD handler, wherever the process was (a program's own handler can chain it).
        died = None if is_user_error(error) else worker_died("a loader worker of the data", workers, error)
        if died is not None:
            raise died from error
        raise


def _check_same_config(cfg: Any, strategy: Any) -> None:
    """Every rank must train the job rank 0 trains (a sweep's ranks must never mix jobs' values)."""
    from runner.sweep import config_hash

    mine = config_hash(cfg)
    log.info("config hash %s (every rank checks it equals rank 0's)", mine)
    reference = strategy.broadcast(mine)
    if mine != reference:
        raise RuntimeError(f"rank {strategy.global_rank} has config {mine} but rank 0 has {reference}")


def _train(cfg: Any, strategy: Any, run_dir: Path, ckpt_path: Any, stop: StopRequest) -> dict:
    from omegaconf import OmegaConf

    seed_everything(cfg.trainer.seed, cfg.trainer.deterministic)
    beat = heartbeat.from_environment(strategy.global_rank)  # from here: a hang before the first step is named
    _import_named_modules(cfg, strategy.is_global_zero)
    beat.phase(heartbeat.START, "its start-up (before the data's hooks)")
    info = stages.run_info(strategy, cfg.trainer.num_nodes)
    if strategy.is_global_zero:
        log.info(stages.run_line(info))
    precision = strategy.precision
    view = TrainerView(cfg, strategy, run_dir)  # what Lightning code reads as `self.trainer` (a data module's too)
    # Lightning's order for a LightningModule: its data module is set up before the module's setup(stage).
    data = build.build_data(cfg, strategy, view, beat) if is_lightning_config(cfg) else None
    with precision.module_init_context():
        model = build.build_model(cfg)
    setup_module(model, view)  # a LightningModule: its trainer view, setup(stage), configure_model()
    task = TaskModule(precision.convert_module(model), build.build_task(cfg), precision)
    strategy.module_to_device(task)
    compile_arguments = build.compile_arguments(cfg)
    if compile_arguments is not None:
        # In place: the module keeps its state_dict keys, so checkpoints load with or without compile.
        task.compile(**compile_arguments)
    wrapped = strategy.setup_module(task)
    data = build.build_data(cfg, strategy, view, beat) if data is None else data
    sampler_kwargs = strategy.distributed_sampler_kwargs
    dev_run = bool(cfg.trainer.fast_dev_run)
    logger = build.build_logger(cfg, run_dir, strategy.is_global_zero and not dev_run)
    train, val = _loaders(data, sampler_kwargs, cfg.trainer.seed, cfg.get("stage", "fit"))
    # Schedulers decay over the steps the run takes, counted after processes, accumulation and epochs.
    total_steps = make_schedule(cfg.trainer, train.batches, loader_length(val) if val is not None else 0).total_steps
    view.plan(total_steps)  # trainer.estimated_stepping_batches, which configure_optimizers() may read
    optimizer = build.build_optimizer(cfg, model)
    hparams = {**flatten(OmegaConf.to_container(cfg, resolve=True)), **flatten(info, "run/")}
    callbacks = build.build_callbacks(cfg)
    if dev_run:
        stages.dev_run_only(callbacks, int(cfg.trainer.fast_dev_run), strategy.is_global_zero)
    loop = Loop(strategy, task, wrapped, optimizer, build.build_scheduler(cfg, optimizer, total_steps), train, val,
                logger, cfg.trainer, run_dir, stop, hparams, build.build_metrics(cfg, strategy), callbacks,
                run_info=info, make_scheduler=lambda steps: build.build_scheduler(cfg, optimizer, steps))
    attach_lightning(loop, view)  # the view follows the loop; Lightning's hooks and self.log, where there are any
    heartbeat.attach(beat, loop, compiled=compile_arguments is not None)
    if compile_arguments is not None:
        loop.callbacks.by_name[CompileLines.NAME] = CompileLines(compile_arguments)
    stage = cfg.get("stage", "fit")
    if stage != "fit":
        beat.pause()  # an evaluation stage has no steps to watch
    if strategy.is_global_zero:  # once everything is built: a run refused before its loop leaves no trace
        # model.json: what runner.export --format hf / lightning reads, as data
        record_model(model, run_dir, lightning=is_lightning_module(model))
    ckpt_path = _restart_checkpoint(run_dir) or ckpt_path
    trusted = bool(cfg.trainer.get("trust_unchecked_checkpoint", False))  # the pre-launch check said where
    try:
        if ckpt_path and stage == "fit":
            log.info("resuming from %s", ckpt_path)
            loop.load_state_dict(strategy.load_checkpoint(ckpt_path, trust_unchecked=trusted))
        elif ckpt_path:
            log.info("stage=%s with the weights of %s", stage, ckpt_path)
            loop.load_weights(strategy.load_checkpoint(ckpt_path, trust_unchecked=trusted))
        result = stages.RUN[stage](loop, data)
    finally:
        close_loaders(train, val)
        beat.pause()  # the loggers' last writes or upload, on rank 0 alone, may take long
        logger.finalize()
    beat.phase(heartbeat.DONE, "its exit (after the run)")  # watched: rank 0 has written all the run keeps
    return result


def _import_named_modules(cfg: Any, global_zero: bool) -> None:
    """The modules the config names, imported before anything is built, seeded, in the process group and watched (as
    the builds would import them); a launched worker's start ends here (runner.collector). A rank other than 0
    builds no logger, and imports none."""
    for key, target in targets(cfg):
        if global_zero or not key.startswith("logger."):
            import_target(target)
    collector.resume()


def _loaders(data: Any, sampler_kwargs: Any, seed: int, stage: str) -> tuple[Any, Any]:
    """The train and val loaders. A data module set up for validate, test or predict may have no train split: the
    stage's own loader then stands in for the loop's sizes (nothing trains on it)."""
    if stage == "fit" or getattr(data, "train_dataset", None) is not None:
        return train_loader(data, sampler_kwargs, seed), val_loader(data, sampler_kwargs, seed)
    split = STAGE_SPLITS[stage][0]
    stand_in = val_loader(data, sampler_kwargs, seed, split)
    if stand_in is None:
        raise stages.missing_split(data, split, stage)
    size = stand_in.batch_size or data.batch_size  # a stream's share batches by itself
    return TrainBatches(stand_in, size, None, {}, f"data.{split}_dataset"), val_loader(data, sampler_kwargs, seed)


_TEMPORARY = re.compile(r"\.tmp-(\d+)(-[0-9a-f]+)?$")  # what atomic writes name their file until the rename


def remove_stale_temporaries(run_dir: Path) -> None:
    """Delete the half-written files a killed process left in the run folder (no rename ever came for them)."""
    stale = []
    for folder in (run_dir, run_dir / "checkpoints"):
        for path in folder.iterdir() if folder.is_dir() else ():
            match = _TEMPORARY.search(path.name)
            if match and path.is_file() and not alive(int(match.group(1))):
                stale.append(path)
    for path in stale:
        with contextlib.suppress(OSError):
            path.unlink()
    if stale:
        log.warning("removed %d half-written file(s) an earlier, killed process left: %s", len(stale),
                    ", ".join(p.name for p in stale))


def _requeue_slurm_job() -> None:
    job_id, scontrol = os.environ.get("SLURM_JOB_ID"), shutil.which("scontrol")
    if not (job_id and scontrol):
        log.warning("SIGUSR1: last.ckpt saved, but the job is not requeued (scontrol or SLURM_JOB_ID missing)")
        return
    done = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True)
    if done.returncode:
        log.warning("scontrol requeue %s failed: %s", job_id, (done.stderr or done.stdout).strip())
    else:
        log.info("requeued SLURM job %s; it resumes from last.ckpt in this run folder", job_id)


def _restart_checkpoint(run_dir: Path) -> Any:
    """Workers restarted by torchelastic, or a job requeued by SLURM, continue from the run's last checkpoint."""
    last = run_dir / "checkpoints" / "last.ckpt"
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) or int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if not restarts:
        return None
    log.warning("restart %d of this job (torchelastic after a failure, or a SLURM requeue); %s", restarts,
                "resuming from the job's last.ckpt" if last.exists() else "no last.ckpt yet: starting over")
    return str(last) if last.exists() else None


@record
def run_from_file(config_file: str, run_dir: str, parent: int) -> None:
    """A launched worker, once `runner.entry.main` has set up its process: train the job the parent wrote.

    `parent`: the launcher's pid, from the process's first moments.
    """
    from omegaconf import OmegaConf

    from runner.errors import constructor_failure, is_user_error, user_code_failure

    cfg = OmegaConf.load(config_file)
    # Open while the worker runs: the launcher's stall watch asks for this rank's stacks by signal.
    stacks_file = heartbeat.dump_stacks_on_signal(int(os.environ.get("RANK", "0")))  # noqa: F841
    try:
        run(cfg, run_dir, ckpt_path=cfg.trainer.get("ckpt_path"), launched=True)
    except Exception as error:
        error = constructor_failure(error)  # a class that refused its settings: its own words, one line
        error = user_code_failure(error, str(heartbeat.log_path(Path(run_dir), int(os.environ.get("RANK", "0")))))
        consequence = peer_gone(error)
        if not (consequence or is_user_error(error)):
            raise  # a bug: `record` passes the traceback to the launcher
        # The launcher prints the error, naming the rank (once, whichever rank it was); a rank that only saw
        # another one go away keeps its side of it, with the traceback, in its log.
        _log_to_file(error, with_traceback=consequence)
        _report_to_launcher(error)
        if consequence or FOLLOWS_ANOTHER in str(error):
            # The rank whose failure this follows reports its own now: the launcher ends this one when that one
            # ends, rather than take this report, in the other's words, for the cause.
            time.sleep(CONSEQUENCE_WAIT_S)
        sys.exit(1)
    finally:
        if os.getppid() != parent:
            # The launcher died (even by SIGKILL): nobody will collect this worker's result, and a spawned
            # worker would wait for it forever. It has stopped at a step and saved; end now.
            logging.shutdown()
            os._exit(128 + signal.SIGTERM)


def _log_to_file(error: BaseException, with_traceback: bool) -> None:
    """The error in this rank's log file(s), not on the console."""
    trace = (type(error), error, error.__traceback__) if with_traceback else None
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (error,), trace)
    for handler in log.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _report_to_launcher(error: BaseException) -> None:
    """The message alone, in torchelastic's error file: the launcher shows it without a traceback."""
    from runner.errors import report_to_launcher

    report_to_launcher(str(error), type(error).__name__)
