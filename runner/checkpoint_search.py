"""Which checkpoint `trainer.ckpt_path` names: a file, or `last`/`best` found in the run folder or in the runs of
this config that this user owns. Worked out once, in the job's plan (runner.plan)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from runner.config import ConfigError

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
