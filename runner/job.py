"""One job, in the process Hydra runs: validate, lay out the run folder, then train in-process or launch workers."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import DictConfig, OmegaConf

from runner import run_lock
from runner.composition import drop_unselected_callbacks
from runner.config import ConfigError, make_unique_dir
from runner.launch import launcher_for, start_forkserver
from runner.processes import end_with_parent

if TYPE_CHECKING:
    from runner.plan import Plan

log = logging.getLogger("runner")


# What a checkpoint found by `last`/`best` outside the run folder must share with this run's config: to train on,
# its whole training setup; to validate, test or predict with, what it computes.
SAME_RUN_KEYS = ("model", "data", "task", "optimizer", "scheduler")
SAME_MODEL_KEYS = ("model", "data", "task")


def resolve_ckpt_path(cfg: DictConfig, run_dir: Path) -> Optional[str]:
    """`trainer.ckpt_path`: a file; or `last`/`best`. A run folder that holds checkpoints/ already resumes from
    its own newest complete one (last.ckpt, else the highest step-N.ckpt; best.ckpt for `best`) and never from
    another folder. A new run folder takes one of a run of this config (model, data, task, optimizer and
    scheduler to train on; model, data and task to validate, test or predict with) that this user owns: the
    newest last.ckpt, or the best.ckpt with the best recorded score (`_best_of_runs`)."""
    value = cfg.trainer.ckpt_path
    if value in (None, ""):
        return None
    if value not in ("last", "best"):
        return os.path.abspath(str(value))
    evaluating = cfg.get("stage", "fit") != "fit"  # validate, test, predict: no weights to train from the start
    if (run_dir / "checkpoints").is_dir():
        return _own_checkpoint(value, run_dir, cfg.get("stage") if evaluating else None)
    root = output_root(run_dir)
    found = _runs_of_this_config(cfg, root, f"{value}.ckpt")
    if value == "best" and found:
        return _best_of_runs(cfg, found, root)
    if found:
        newest = max(found, key=lambda p: p.stat().st_mtime)
        log.warning("trainer.ckpt_path=last: using %s, the newest last.ckpt of your runs of this config under %s",
                    newest, root)
        return str(newest.resolve())
    if value == "best":
        raise ConfigError([f"trainer.ckpt_path=best: no checkpoints/best.ckpt in {run_dir}, nor in a run of this "
                           f"config under {root} (best.ckpt is written by callbacks=model_checkpoint)"])
    if evaluating:
        raise ConfigError([f"trainer.ckpt_path=last: no last.ckpt in {run_dir}, nor in a run of this config under "
                           f"{root}; stage={cfg.stage} needs trained weights: name the file with "
                           "trainer.ckpt_path=<file>"])
    log.warning("trainer.ckpt_path=last: no last.ckpt in %s, nor under %s from a run of this config; "
                "training from the start", run_dir, root)
    return None


def _own_checkpoint(value: str, run_dir: Path, evaluating: Optional[str] = None) -> Optional[str]:
    """`last`/`best` in a run folder with checkpoints/: its own, whatever other runs hold. `evaluating`: the stage
    (validate, test, predict) that needs one."""
    folder = run_dir / "checkpoints"
    own = folder / f"{value}.ckpt"
    if not own.exists() and value == "last":
        # Killed before its first last.ckpt: its periodic ones are newer than anything another run has.
        steps = {int(m.group(1)): p for p in folder.glob("step-*.ckpt") if (m := _STEP.fullmatch(p.name))}
        own = steps[max(steps)] if steps else own
    if own.exists():
        log.info("trainer.ckpt_path=%s: %s (this run folder's)", value, own)
        return str(own.resolve())
    if value == "best":
        raise ConfigError([f"trainer.ckpt_path=best: {run_dir} holds a run but no checkpoints/best.ckpt (best.ckpt "
                           "is written by callbacks=model_checkpoint)"])
    if evaluating:
        raise ConfigError([f"trainer.ckpt_path=last: {folder} holds no complete checkpoint; stage={evaluating} needs "
                           "trained weights: name the file with trainer.ckpt_path=<file>"])
    log.warning("trainer.ckpt_path=last: %s holds no complete checkpoint; training from the start", folder)
    return None


_STEP = re.compile(r"step-(\d+)\.ckpt")


def _best_of_runs(cfg: DictConfig, found: list[Path], root: Path) -> str:
    """The best.ckpt of the run whose metrics.json records the best `best_model_score`, among the runs whose
    checkpoint callback ranked by this config's metric and mode (the newest of equal scores). Raises ConfigError
    when none recorded one."""
    monitor, mode = _ranked_by(OmegaConf.to_container(cfg, resolve=True))
    scored = [(score, path.stat().st_mtime, path) for path in found
              if _ranked_by(_resolved_of(path.parent.parent)) == (monitor, mode)
              and (score := _recorded_best_score(path.parent.parent)) is not None]
    if not scored:
        raise ConfigError([f"trainer.ckpt_path=best: {len(found)} run(s) of this config under {root} hold a "
                           f"best.ckpt, but none records a best_model_score by {monitor} (mode {mode}) in its "
                           "metrics.json (ranked by another metric, or never finished): name the checkpoint, "
                           "trainer.ckpt_path=<file>"])
    sign = 1 if mode == "max" else -1
    score, _, best = max(scored, key=lambda item: (sign * item[0], item[1]))
    log.warning("trainer.ckpt_path=best: using %s, of the run with the best %s (mode %s): %.6g, of %d run(s) of "
                "this config under %s", best, monitor, mode, score, len(scored), root)
    return str(best.resolve())


def _ranked_by(config: Any) -> Optional[tuple[str, str]]:
    """The metric and mode a run of `config` (a resolved config) ranks best.ckpt by: its checkpoint callback's
    `monitor` and `mode`; unset ones, or no such callback, follow `objective` and `direction`."""
    if not isinstance(config, dict):
        return None
    callbacks = config.get("callbacks") if isinstance(config.get("callbacks"), dict) else {}
    spec = next((s for s in callbacks.values() if isinstance(s, dict)
                 and s.get("_target_") == "runner.callbacks.ModelCheckpoint"), {})
    return (spec.get("monitor") or config.get("objective") or "val/loss",
            spec.get("mode") or ("max" if config.get("direction") == "maximize" else "min"))


def _recorded_best_score(run: Path) -> Optional[float]:
    """`best_model_score` of the run's metrics.json (the checkpoint callback's best), if it holds a finite one
    and is this user's file."""
    path = run / "metrics.json"
    try:
        if path.stat().st_uid != os.getuid():
            return None
        score = json.loads(path.read_text()).get("best_model_score")
    except (OSError, ValueError, AttributeError):
        return None
    number = isinstance(score, (int, float)) and not isinstance(score, bool)
    return float(score) if number and math.isfinite(score) else None


def _runs_of_this_config(cfg: DictConfig, root: Path, name: str) -> list[Path]:
    """`name` in the run folders under `root` that this config made and this user owns (a folder another user
    left under a shared outputs/ is never loaded)."""
    keys = SAME_RUN_KEYS if cfg.get("stage", "fit") == "fit" else SAME_MODEL_KEYS
    mine = _signature(OmegaConf.to_container(cfg, resolve=True), keys)
    found = []
    for path in (p for pattern in (f"*/checkpoints/{name}", f"*/*/checkpoints/{name}") for p in root.glob(pattern)):
        run = path.parent.parent
        try:
            # stat, not lstat: a link of this user's to another user's checkpoint is that user's checkpoint.
            owned = all(p.stat().st_uid == os.getuid() for p in (path, path.parent, run, run / ".hydra" /
                                                                 "resolved.yaml"))
        except OSError:
            continue
        if owned and _signature(_resolved_of(run), keys) == mine:
            found.append(path)
    return found


def output_root(run_dir: Path) -> Path:
    """Where runs are kept: the run folder's parent, above the date folder of Hydra's default layout."""
    parent = Path(run_dir).resolve().parent
    return parent.parent if re.fullmatch(r"\d{4}-\d{2}-\d{2}", parent.name) else parent


def _signature(config: Any, keys: tuple[str, ...]) -> Any:
    return None if not isinstance(config, dict) else {key: config.get(key) for key in keys}


def _resolved_of(run_dir: Path) -> Any:
    try:
        return OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "resolved.yaml"))
    except (OSError, ValueError, AttributeError):
        return None


def resolved_config(cfg: DictConfig, strategy: Any, ckpt_path: Optional[str]) -> dict:
    """The config workers build from: interpolations resolved, `auto` choices made once, here."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved.pop("hydra", None)
    environment = getattr(strategy, "cluster_environment", None)
    if environment is not None:
        resolved["cluster"] = {"_target_": f"{type(environment).__module__}.{type(environment).__qualname__}"}
    resolved["trainer"]["ckpt_path"] = ckpt_path
    return resolved


def _external(strategy: Any) -> bool:
    environment = getattr(strategy, "cluster_environment", None)
    return bool(environment is not None and environment.creates_processes_externally)


def check_writable(plan: Plan, run_dir: Path) -> None:
    """The run folder, checkpoints/ and the built-in loggers' folders can take files: found before the workers
    start, not at the first log step or checkpoint. Nothing is created here."""
    folders = [run_dir, run_dir / "checkpoints"]
    for spec in plan.loggers.values():
        root = Path(spec.get("root_dir") or run_dir)
        if spec.get("_target_") == "runner.loggers.TensorBoardLogger":
            folders.append(root / spec.get("subdir", "tensorboard"))
        elif spec.get("_target_") == "runner.loggers.CSVLogger":
            folders.append(root)
    problems = []
    for folder in dict.fromkeys(folders):
        existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)
        if not existing.is_dir():
            problems.append(f"cannot write in {folder}: {existing} is a file, not a folder")
        elif not os.access(existing, os.W_OK | os.X_OK):
            problems.append(f"cannot write in {folder}: {existing} is not writable by this user")
    if problems:
        raise ConfigError(problems)


def default_run_dir() -> Path:
    """A new folder per call (fit() from Python may run several jobs within one second)."""
    return Path(make_unique_dir(time.strftime("outputs/%Y-%m-%d/%H-%M-%S")))


def fit(cfg: DictConfig, run_dir: Any = None, own_logging: bool = True, job_logging: Optional[dict] = None) -> dict:
    """Run one job from a composed config and return its final metrics (see `runner.fit`).

    `job_logging`: the job's `hydra/job_logging` when it is not Hydra's default, for the workers to apply.
    `stage=check` (or check_data) checks the config instead, see `check`.
    """
    from runner.errors import constructor_failure

    try:
        if cfg.get("stage") in ("check", "check_data"):
            return check(cfg, run_dir)
        run_dir = Path(run_dir) if run_dir is not None else default_run_dir()
        if _forks_from_a_server(cfg):
            start_forkserver()  # its imports (torch, the worker) run while this process checks the config
        # torch comes with these (not at this module's import): the server above imports it beside this process
        from runner.build import handing_over_data
        from runner.checks import validate
        from runner.plan import Plan
        from runner.stages import record_dir

        drop_unselected_callbacks(cfg)
        ckpt_path = resolve_ckpt_path(cfg, run_dir)
        run_dir = record_dir(str(cfg.get("stage", "fit")), run_dir)  # an evaluation in a fit's folder: its own
        plan = Plan(cfg)  # what the checks read, and the job goes on with: each piece built once
        # The data the checks build is the data this process's worker trains on: built once, not twice.
        with handing_over_data(lambda: _trains_here(plan)):
            validate(cfg, ckpt_path, plan)
            check_writable(plan, run_dir)
            return _run(plan, run_dir, ckpt_path, own_logging, job_logging)
    except Exception as error:  # a constructor's refusal: the runner's line, or the user's class and its error
        said = constructor_failure(error)
        if said is error:
            raise
        raise said from error.__cause__


def _forks_from_a_server(cfg: DictConfig) -> bool:
    """Whether this job will most likely launch forkserver workers: several devices asked for, in a process no
    launcher (torchrun, srun) started. A guess made before the checks, for a head start: the launch starts the
    server anyway when it is needed."""
    devices = cfg.trainer.get("devices")
    several = (isinstance(devices, int) and not isinstance(devices, bool) and devices > 1) or (
        OmegaConf.is_list(devices) and len(devices) > 1)
    external = any(name in os.environ for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID"))
    return cfg.strategy.get("start_method") == "forkserver" and several and not external


# Where `trainer.ckpt_path=last|best` is looked for by a check without a run folder: the runs under outputs/, where
# a training run of the default layout would look. Never created.
_UNMADE_RUN_DIR = Path("outputs") / "check"


def check(cfg: DictConfig, run_dir: Any = None) -> dict:
    """`stage=check`: every check the training run would pass (its checkpoint's too, `run_dir` or outputs/ finding
    `last`/`best`), the model and task on the meta device over the first batch's shapes, and what it learned
    (runner.checks.dry_run.check_config). Nothing is launched, trained or written."""
    from runner.checks.dry_run import check_config, training_config

    drop_unselected_callbacks(cfg)
    ckpt_path = resolve_ckpt_path(training_config(cfg), Path(run_dir) if run_dir is not None else _UNMADE_RUN_DIR)
    return check_config(cfg, ckpt_path)


def _trains_here(plan: Plan) -> bool:
    """Whether a worker trains in this process (one process; a rank torchrun or srun started), rather than in
    processes a launcher starts."""
    strategy = plan.strategy
    return launcher_for(strategy.processes, plan.cfg.trainer.get("max_restarts", 0), _external(strategy)) is None


def _run(plan: Plan, run_dir: Path, ckpt_path: Optional[str], own_logging: bool,
         job_logging: Optional[dict]) -> dict:
    """A validated job: its run folder, then training here (with the plan's strategy) or in the workers a launcher
    starts."""
    from runner import worker
    from runner.logs import save_job_logging

    cfg, strategy = plan.cfg, plan.strategy
    resolved = OmegaConf.create(resolved_config(cfg, strategy, ckpt_path))
    if _external(strategy) and os.environ.get("TORCHELASTIC_RUN_ID"):
        end_with_parent()  # torchrun's ranks lead sessions of their own: none may outlive a killed torchrun
    if _external(strategy) and strategy.global_rank != 0:
        # torchrun or srun started this rank: rank 0 writes the run folder, whose path it broadcasts.
        return worker.run(resolved, run_dir, ckpt_path, own_logging=own_logging, strategy=strategy)
    run_lock.acquire(run_dir)  # before this run writes anything in the folder; kept until the job ends
    try:
        restarted = any(int(os.environ.get(name, "0") or 0) for name in ("TORCHELASTIC_RESTART_COUNT",
                                                                         "SLURM_RESTART_COUNT"))
        if ckpt_path is None and (run_dir / "checkpoints" / "last.ckpt").exists() and not restarted:
            # said once the run will start; a restarted or requeued job resumes from it (runner.worker says so)
            log.warning("%s already holds a run; this one starts from scratch and replaces its checkpoints "
                        "(trainer.ckpt_path=last continues it instead)", run_dir)
        save_job_logging(run_dir, job_logging)
        _write_config_record(cfg, resolved, run_dir)
        launcher = launcher_for(strategy.processes, cfg.trainer.get("max_restarts", 0), _external(strategy))
        if launcher is None:
            return worker.run(resolved, run_dir, ckpt_path, own_logging=own_logging, strategy=strategy)
        log.info("starting %d worker processes (%s)", launcher.num_processes, launcher.start_method)
        # The workers read their own copy, in the launch's private folder: nothing written into the run folder
        # meanwhile changes what they build.
        launcher.launch(resolved, run_dir, deterministic=cfg.trainer.deterministic)
        return json.loads((run_dir / "metrics.json").read_text())
    finally:
        run_lock.release(run_dir)


def _write_config_record(cfg: DictConfig, resolved: DictConfig, run_dir: Path) -> None:
    """.hydra/resolved.yaml: what this job runs, for the user and for `last`/`best` searches (workers never
    read it)."""
    from runner.files import write_text

    records = run_dir / ".hydra"
    run_lock.refuse_linked_records(records)
    if not (records / "config.yaml").exists():  # called from Python: no Hydra wrote it
        write_text(records / "config.yaml", OmegaConf.to_yaml(cfg))
    write_text(records / "resolved.yaml", OmegaConf.to_yaml(resolved))  # a link planted there is replaced
