"""What a run hands back: its result dict, written to metrics.json (rank 0, atomically) and logged.

Path: CLI → validate → run folder → launch → worker → build → [loop] → teardown; the stages
(`runner.stages`) write their results through the loop, the job reads metrics.json after the workers end.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any, Optional

from runner.loop.progress import fmt

log = logging.getLogger("runner")


def fit_result(loop: Any, signalled: int, stop_reason: Optional[str]) -> dict:
    """The end of training: the last metrics, where it stopped, and what stopped it before its max_steps or
    max_epochs: `stopped_early` says whether something did, `stopped_by` what (a callback's reason, or the
    signal), and `stop_signal` is there only when a signal did, which leaves the run to resume. A signal that came
    once every step was taken (at the last step, or in the final validation) stops nothing: the run is complete.

    `skipped_steps`: this run's steps whose every batch was skipped on every process (a LightningModule's
    training_step returned None): `step` counts them, as Lightning's global_step does, but no optimizer step was
    taken for them."""
    progress, schedule, train_step = loop.progress, loop.schedule, loop.train_step
    ended = progress.step >= schedule.max_steps or progress.epoch >= schedule.max_epochs or stop_reason is not None
    if signalled and ended:
        if loop.strategy.is_global_zero:
            log.warning("%s came after the last step (%d): the run is complete, nothing to resume; the final "
                        "validation %s", signal.Signals(signalled).name, progress.step,
                        "ran before it" if loop.last_val_step == progress.step else "was skipped")
        signalled = 0
    result = {**progress.metrics, "step": progress.step, "epoch": progress.epoch,
              "stopped_early": bool(signalled) or stop_reason is not None}
    if train_step.empty_steps:
        result["skipped_steps"] = train_step.empty_steps
        result["trained"] = train_step.empty_steps < train_step.taken
    if signalled:
        result["stop_signal"] = signalled
        stop_reason = f"signal {signal.Signals(signalled).name}"
    if stop_reason is not None:
        result["stopped_by"] = stop_reason
        log.info("stopped at step %d by %s", progress.step, stop_reason)
    return result


def publish(loop: Any, result: dict) -> None:
    """Rank 0 at the end of training: the final metrics with the hyperparameters, metrics.json, the last line."""
    final = {k: v for k, v in result.items() if isinstance(v, float)}
    loop.logger.log_hyperparams(loop.hparams, final)
    _write_json(loop.run_dir / "metrics.json", result)
    loop.console.end()
    if result.get("trained", True):
        log.info("done: %s", fmt(result))
    else:  # the one line of a run that ran its steps and trained nothing
        log.warning("done, and nothing trained: every batch of this run's %d steps was skipped (training_step returned "
                    "None), so no optimizer step was taken and the weights are as they started; step %d counts the "
                    "skipped steps, as Lightning's global_step does", result["skipped_steps"], result["step"])


def write_result(run_dir: Path, result: dict, is_global_zero: bool) -> None:
    """metrics.json (rank 0)."""
    if is_global_zero:
        _write_json(run_dir / "metrics.json", result)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
