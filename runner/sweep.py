"""Sweeps: each job of `python -m runner -m ...` is a full run; finished jobs are skipped, stopped ones resumed,
the sweep folder keeps a summary table of every job (how many passed and failed first, then the best where jobs
compare), and `direction` reaches the sweeper.

A job's score is its objective's best over its validations when the run records one (metrics.json's `best`),
else its last value: what the sweeper gets back, and what the summary ranks."""

from __future__ import annotations

import csv
import fcntl
import hashlib
import io
import json
import logging
import shutil
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

from runner import files
from runner.config import ConfigError

log = logging.getLogger("runner")
DIRECTIONS = ("minimize", "maximize")
STATUS_FILE = ".hydra/job_status.json"


# Keys a job may change and still continue from its checkpoint (asking for more steps or epochs).
_LENGTH_KEYS = ("max_steps", "max_epochs")


def config_hash(cfg: DictConfig, ignore_length: bool = False) -> str:
    """What makes a job the same job again: its resolved config, wherever it resumes from."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved.pop("hydra", None)
    trainer = resolved.get("trainer", {})
    for key in ("ckpt_path", *(_LENGTH_KEYS if ignore_length else ())):
        trainer.pop(key, None)
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:16]


def finished_metrics(job_dir: Path, digest: str) -> Optional[dict]:
    """The metrics of this job from an earlier run of the same sweep, if it finished with the same config."""
    try:
        status = json.loads((job_dir / STATUS_FILE).read_text())
        metrics = json.loads((job_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return None
    if status.get("status") == "ok" and status.get("config_hash") == digest and not metrics.get("stop_signal"):
        return metrics
    return None


def run_job(cfg: DictConfig, job_dir: Path, sweep_dir: Path, fit: Callable[..., dict]) -> dict:
    """Run (or skip, or resume) one job and record its outcome in the job folder and the sweep summary.

    Raises what `fit` raised, after recording the job as failed.
    """
    if cfg.get("stage") in _CHECK_STAGES:
        return _check_job(cfg, job_dir, sweep_dir, fit)
    digest = config_hash(cfg)
    metrics = finished_metrics(job_dir, digest)
    smoke = bool(cfg.trainer.get("fast_dev_run"))
    if metrics is not None:
        log.info("job %s finished in an earlier run of this sweep: skipped", job_dir.name)
        _write_summary(sweep_dir, cfg.objective, cfg.direction, smoke=smoke)
        return metrics
    status: dict[str, Any] = {"status": "running", "config_hash": digest,
                              "resume_hash": config_hash(cfg, ignore_length=True)}
    if cfg.trainer.ckpt_path is None:
        _continue_or_clear(cfg, job_dir, status["resume_hash"])
    _write_status(job_dir, status)
    start = time.time()
    try:
        metrics = fit(cfg, job_dir)
        status["status"] = "stopped" if metrics.get("stop_signal") else "ok"  # a signal's stop resumes
        return metrics
    except BaseException as error:
        status.update(status="stopped" if hasattr(error, "signum") else "failed",  # JobStopped: by a signal
                      error=" ".join(str(error).split())[:500] or type(error).__name__)
        raise
    finally:
        status["wall_time_s"] = round(time.time() - start, 2)
        _write_status(job_dir, status)
        _write_summary(sweep_dir, cfg.objective, cfg.direction, smoke=smoke)


_CHECK_STAGES = ("check", "check_data")


def _check_job(cfg: DictConfig, job_dir: Path, sweep_dir: Path, fit: Callable[..., dict]) -> dict:
    """`-m stage=check ...`: one config checked in this process (never skipped: the code it names may have
    changed), its outcome in the summary: ok with what the check learned, or failed with its first problem."""
    status: dict[str, Any] = {"status": "running", "stage": cfg.stage}
    start = time.time()
    try:
        findings = fit(cfg, job_dir)
        status.update(status="ok", check={k: v for k, v in findings.items()
                                          if isinstance(v, (int, float)) and not isinstance(v, bool)})
        return findings
    except BaseException as error:
        status.update(status="failed", error=first_problem(error))
        raise
    finally:
        status["wall_time_s"] = round(time.time() - start, 2)
        _write_status(job_dir, status)
        _write_summary(sweep_dir, cfg.objective, cfg.direction, checking=True)


def first_problem(error: BaseException) -> str:
    """The first line a failed job's error gives (a ConfigError's first problem), and how many more it has."""
    problems = getattr(error, "problems", None) or [str(error) or type(error).__name__]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return " ".join(str(problems[0]).split())[:500] + more


def _continue_or_clear(cfg: DictConfig, job_dir: Path, resume_hash: str) -> None:
    """An earlier run of this sweep left this job unfinished: continue it if it is the same job, else start over.

    A job folder of a sweep run with other values holds another job's checkpoint, events and metrics.
    """
    last = job_dir / "checkpoints" / "last.ckpt"
    if not last.exists():
        return
    try:
        earlier = json.loads((job_dir / STATUS_FILE).read_text()).get("resume_hash")
    except (OSError, ValueError):
        earlier = None
    if earlier == resume_hash:
        cfg.trainer.ckpt_path = str(last)
        return
    log.warning("job %s: %s holds a run with another config; starting this job from scratch", job_dir.name,
                job_dir)
    for stale in ("checkpoints", "tensorboard"):
        shutil.rmtree(job_dir / stale, ignore_errors=True)
    for stale in ("metrics.json", "metrics.csv"):
        (job_dir / stale).unlink(missing_ok=True)


def _write_status(job_dir: Path, status: dict) -> None:
    (job_dir / STATUS_FILE).parent.mkdir(parents=True, exist_ok=True)
    _replace(job_dir / STATUS_FILE, json.dumps(status, indent=2) + "\n")


def objective_value(metrics: dict, objective: str) -> Any:
    """What a job scores by `objective`: the best over its validations, where its metrics record it, else the
    last value (None when the run has neither)."""
    best = recorded_best(metrics, objective)
    return best["value"] if best is not None else metrics.get(objective)


def recorded_best(metrics: dict, objective: str) -> Optional[dict]:
    """metrics.json's `best` ({metric, value, step}: the objective's best over the run's validations), when it is
    of `objective`."""
    best = metrics.get("best")
    return best if isinstance(best, dict) and best.get("metric") == objective and "value" in best else None


def _job_rows(sweep_dir: Path, objective: str) -> list[dict]:
    rows = []
    for status_file in sweep_dir.glob("*/" + STATUS_FILE):
        job_dir = status_file.parent.parent
        status = json.loads(status_file.read_text())
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.load(overrides_file) if overrides_file.exists() else []
        try:
            metrics = json.loads((job_dir / "metrics.json").read_text())
        except (OSError, ValueError):
            metrics = {}
        row = {"job": job_dir.name, "overrides": " ".join(overrides), "status": status["status"],
               "wall_time_s": status.get("wall_time_s", "")}
        row.update({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        row.update(status.get("check", {}))  # a checked config: parameters, FLOPs, bytes per process
        best = recorded_best(metrics, objective)
        if best is not None:  # beside the last value of each metric
            row.update({f"{objective} best": best["value"], f"{objective} best step": best.get("step")})
        row["error"] = status.get("error", "")
        rows.append(row)
    return sorted(rows, key=lambda r: (not r["job"].isdigit(), int(r["job"]) if r["job"].isdigit() else r["job"]))


def best_job(rows: list[dict], objective: str, direction: str) -> Optional[dict]:
    """The finished job with the lowest (minimize) or highest (maximize) finite score by `objective` (its best
    over its validations where recorded, else its last value), if any."""
    scored = [r for r in rows if r["status"] == "ok" and isinstance(_score(r, objective), (int, float))
              and math.isfinite(_score(r, objective))]
    if not scored:
        return None
    pick = min if direction == "minimize" else max
    return pick(scored, key=lambda r: _score(r, objective))


def _score(row: dict, objective: str) -> Any:
    return row.get(f"{objective} best", row.get(objective))


def _counts(rows: list[dict]) -> str:
    """summary.md's first line for a sweep that trains: how many jobs passed and failed, and the first that failed."""
    statuses = [r["status"] for r in rows]
    failed = [r for r in rows if r["status"] == "failed"]
    others = "".join(f", {statuses.count(s)} {s}" for s in ("stopped", "running") if s in statuses)
    first = f"; the first failed: job {failed[0]['job']} ({failed[0]['overrides']}): {failed[0]['error']}" if failed else ""
    return f"{len(rows)} job(s): {statuses.count('ok')} passed, {len(failed)} failed{others}{first}."


def _unranked(rows: list[dict], objective: str, smoke: bool) -> Optional[str]:
    """Why no job is named best, where a best would mislead: one batch of trainer.fast_dev_run, or jobs of different
    experiments (a nightly `'experiment=glob(*)'`), whose scores do not compare."""
    if smoke:
        return f"No best job: trainer.fast_dev_run runs one batch per loop, a smoke test whose {objective} ranks nothing."
    experiments = {word for r in rows for word in str(r["overrides"]).split() if word.startswith("experiment=")}
    if len(experiments) > 1:
        return (f"No best job: the jobs run {len(experiments)} different experiments, whose {objective} values do not "
                "compare.")
    return None


def _verdict(best: Optional[dict], objective: str, direction: str) -> str:
    """summary.md's line on the best job: its score and which value of the job that is."""
    if best is None:
        return f"No finished job has {objective} yet ({direction})."
    overrides = f" ({best['overrides']})" if best["overrides"] else ""
    if f"{objective} best" not in best:
        return f"Best job by {objective} ({direction}): {best['job']}, {objective} = {best[objective]:.6g}{overrides}."
    last = f"{best[objective]:.6g}" if isinstance(best.get(objective), (int, float)) else "none"
    return (f"Best job by {objective} ({direction}): {best['job']}, {objective} = {best[objective + ' best']:.6g}, "
            f"the best of its validations (step {best[objective + ' best step']}; last {last}){overrides}.")


def _check_verdict(rows: list[dict]) -> str:
    """summary.md's first line for `-m stage=check`: how many configs passed, and the first that did not."""
    failed = [r for r in rows if r["status"] != "ok"]
    first = f"; the first failed: job {failed[0]['job']} ({failed[0]['overrides']}): {failed[0]['error']}" if failed else ""
    return f"Checked {len(rows)} config(s): {len(rows) - len(failed)} passed, {len(failed)} failed{first}."


def _write_summary(sweep_dir: Path, objective: str, direction: str, checking: bool = False,
                   smoke: bool = False) -> None:
    """Rewrite summary.csv and summary.md from every job folder (under a lock: jobs may end in parallel).
    `checking`: a sweep of stage=check, whose rows say which configs passed and, for the others, the first problem;
    `smoke`: a sweep of trainer.fast_dev_run, whose jobs are ranked by nothing."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(files.open_own(sweep_dir / ".summary.lock", os.O_WRONLY), "w") as lock:  # never through a link
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = _job_rows(sweep_dir, objective)
        unranked = None if checking else _unranked(rows, objective, smoke)
        best = None if checking or unranked else best_job(rows, objective, direction)
        for row in rows:
            row.update({} if checking else {"best": "yes" if row is best else ""})
        columns = list(dict.fromkeys(key for row in rows for key in row))
        for last in ("error",) if checking else ("best", "error"):
            columns.append(columns.pop(columns.index(last)))
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
        _replace(sweep_dir / "summary.csv", buffer.getvalue())
        verdict = _check_verdict(rows) if checking else \
            _counts(rows) + "\n" + (unranked or _verdict(best, objective, direction))
        _replace(sweep_dir / "summary.md", verdict + "\n\n" + _markdown(rows, columns))


def set_sweeper_direction(config: DictConfig) -> None:
    """Give a sweeper with a direction of its own (Optuna's `hydra.sweeper.direction`) the config's `direction`.

    `direction` is the one setting: a different `hydra.sweeper.direction` typed beside it is refused rather
    than silently overruled. Raises ConfigError.
    """
    sweeper = config.hydra.sweeper
    if "direction" not in sweeper:
        return
    direction = config.get("direction")
    if direction not in DIRECTIONS:
        raise ConfigError([f"direction={direction} is not allowed: use minimize or maximize "
                           f"(for objective={config.get('objective')})"])
    typed = [o.split("=", 1)[1] for o in config.hydra.overrides.hydra
             if o.split("=", 1)[0].lstrip("+~") == "hydra.sweeper.direction"]
    if typed and typed[-1] != direction:
        raise ConfigError([f"hydra.sweeper.direction={typed[-1]} contradicts direction={direction}: "
                           f"set direction={typed[-1]} alone (it reaches the sweeper)"])
    with read_write(sweeper):
        sweeper.direction = direction
    log.info("sweeper direction: %s %s", direction, config.get("objective"))


SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
_ONE_PROCESS = ("runner.strategies.DataParallelStrategy", "runner.strategies.SingleDeviceStrategy")
_CPU = "runner.accelerators.CPUAccelerator"


def set_slurm_tasks(config: DictConfig) -> None:
    """Under `hydra/launcher=submitit_slurm`, one SLURM task per process the job runs, on `trainer.num_nodes` nodes.

    Each task is then one rank the runner finds through SLURM's variables (it spawns nothing under srun); submitit's
    default of one task per node left `strategy=ddp trainer.devices=8` one process short of seven. GPUs per node
    follow the devices too, unless the accelerator is the CPU. A value typed for the launcher is kept when it agrees
    and refused when it does not. Raises ConfigError."""
    launcher = config.hydra.get("launcher")
    if launcher is None or launcher.get("_target_") != SLURM_LAUNCHER:
        return
    tasks_override = [o for o in config.hydra.overrides.task
                      if o.split("=", 1)[0].lstrip("+~") in ("trainer.devices", "trainer.num_nodes") and
                      ("," in o or "(" in o)]
    if tasks_override:
        raise ConfigError([f"{tasks_override[0]} with hydra/launcher=submitit_slurm: the launcher asks SLURM for one "
                           "number of tasks per sweep; sweep trainer.devices and trainer.num_nodes in separate "
                           "commands"])
    devices, nodes = config.trainer.devices, config.trainer.num_nodes
    one_process = config.strategy.get("_target_") in _ONE_PROCESS
    if not isinstance(devices, int) and not one_process:
        raise ConfigError([f"trainer.devices={devices} with hydra/launcher=submitit_slurm: give the devices per node "
                           "as a number (e.g. trainer.devices=8): each becomes one SLURM task"])
    wanted = {"tasks_per_node": 1 if one_process else devices, "nodes": nodes}
    if config.accelerator.get("_target_") != _CPU and isinstance(devices, int):
        wanted["gpus_per_node"] = devices
    typed = {o.split("=", 1)[0].lstrip("+~")[len("hydra.launcher."):]: o.split("=", 1)[1]
             for o in config.hydra.overrides.hydra if o.lstrip("+~").startswith("hydra.launcher.") and "=" in o}
    for key, value in wanted.items():
        if key in typed and typed[key] != str(value):
            raise ConfigError([f"hydra.launcher.{key}={typed[key]} contradicts {_why(key, devices, nodes)}: drop "
                               f"hydra.launcher.{key} (the runner sets it to {value})"])
    with read_write(launcher):
        for key, value in wanted.items():
            launcher[key] = value
    log.info("submitit: %s", ", ".join(f"hydra.launcher.{key}={value}" for key, value in wanted.items()))


def _why(key: str, devices: Any, nodes: int) -> str:
    return f"trainer.num_nodes={nodes}" if key == "nodes" else f"trainer.devices={devices}"


class SweepDirection(Callback):
    """`set_sweeper_direction` and `set_slurm_tasks`, called by Hydra with the composed config before it builds the
    sweeper (and its launcher)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            set_sweeper_direction(config)
            set_slurm_tasks(config)
        except ConfigError as error:
            # Hydra turns a callback's exceptions into warnings and goes on: the sweep must not start.
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(1) from None


def _markdown(rows: list[dict], columns: list[str]) -> str:
    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _replace(path: Path, text: str) -> None:
    """Write `path` whole or not at all. The temporary name is this writer's own (process id and random): under a
    launcher that runs every task of a job (submitit's tasks_per_node > 1) each task writes the same records."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x") as file:  # "x": never another writer's file
            file.write(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
