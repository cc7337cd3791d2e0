"""One job, in the process Hydra runs: validate, lay out the run folder, then train in-process or launch workers."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import DictConfig, OmegaConf

from runner import run_lock
from runner.composition import drop_unselected_callbacks
from runner.config import make_unique_dir
from runner.launch import start_forkserver
from runner.processes import end_with_parent

if TYPE_CHECKING:
    from runner.plan import Plan

log = logging.getLogger("runner")


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
        from runner.checks import validate_plan
        from runner.plan import Plan

        drop_unselected_callbacks(cfg)
        plan = Plan(cfg, run_dir)  # what the checks read, and the job goes on with: each piece worked out once
        # The data the checks build is the data this process's worker trains on: built once, not twice.
        with handing_over_data(lambda: plan.launcher is None):
            validate_plan(plan)
            plan.release_trials()
            return _run(plan, own_logging, job_logging)
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
    from runner.checks.dry_run import check_config

    drop_unselected_callbacks(cfg)
    return check_config(cfg, Path(run_dir) if run_dir is not None else _UNMADE_RUN_DIR)


def _run(plan: Plan, own_logging: bool, job_logging: Optional[dict]) -> dict:
    """A validated job: its run folder, then training here (with the plan's strategy) or in the workers a launcher
    starts."""
    from runner import worker
    from runner.logs import save_job_logging

    cfg, strategy, run_dir, ckpt_path, resolved = plan.cfg, plan.strategy, plan.run_dir, plan.ckpt_path, plan.resolved
    if plan.external and os.environ.get("TORCHELASTIC_RUN_ID"):
        end_with_parent()  # torchrun's ranks lead sessions of their own: none may outlive a killed torchrun
    if plan.external and strategy.global_rank != 0:
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
        launcher = plan.launcher
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
