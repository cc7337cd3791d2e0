"""Callbacks: hooks around the fixed loop (the `callbacks` group), and the built-in ones.

A callback is any class with some of the hooks below; each hook is called on every process with the loop
and what it just did. Metrics passed to hooks are already reduced over processes, so every process sees
the same values; decisions that must agree still go through `loop.strategy` (reduce_boolean_decision),
and files are written through `loop.save_checkpoint` and removed through `loop.remove_checkpoint`, which
act on rank 0. A callback with `state_dict()`/`load_state_dict()` has its state in every checkpoint.

Hooks: on_fit_start(loop), on_train_log(loop, metrics, step), on_validation_end(loop, metrics, step),
on_save_checkpoint(loop, checkpoint) (before a save: may add to the dict), on_checkpoint_saved(loop, path),
on_fit_end(loop, result) (may add to the final result written to metrics.json), on_exception(loop, error).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal, Optional

log = logging.getLogger("runner")
HOOKS = ("on_fit_start", "on_train_log", "on_validation_end", "on_save_checkpoint", "on_checkpoint_saved",
         "on_fit_end", "on_exception")


class CallbackError(ValueError):
    """A callback's setting that only a running job can check (a monitored metric nobody logs)."""


class Callbacks:
    """The configured callbacks by name; calling a hook calls it on each callback that has it, in order."""

    def __init__(self, callbacks: Optional[dict[str, Any]] = None) -> None:
        self.by_name = dict(callbacks or {})

    def call(self, hook: str, *args: Any) -> None:
        for callback in self.by_name.values():
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)

    def state_dict(self) -> dict[str, Any]:
        return {name: c.state_dict() for name, c in self.by_name.items() if hasattr(c, "state_dict")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, callback in self.by_name.items():
            if name in state and hasattr(callback, "load_state_dict"):
                callback.load_state_dict(state[name])


def _require_logged(metrics: dict, setting: str, name: str, when: str) -> None:
    """A metric a setting names (a callback's monitor, the objective) must be among those the run logs."""
    if name not in metrics:
        logged = ", ".join(sorted(k for k in metrics if "/" in k)) or "none"
        raise CallbackError(f"{setting}={name} is not logged {when}; the metrics are: {logged}")


def _monitored(metrics: dict, monitor: str, who: str) -> float:
    _require_logged(metrics, f"callbacks.{who}.monitor", monitor, "at validation")
    return float(metrics[monitor])


class ObjectiveCheck:
    """The job's `objective` (what a sweep optimises, what the summary ranks) must be a metric the run logs.

    Checked where it first could be: a `val/` objective at the first validation, any other at the first training
    log, so a misspelt name stops the run there instead of every job of a sweep training for nothing.
    """

    def __init__(self, objective: str) -> None:
        self.objective = objective
        self.validated = not objective.startswith("val/")  # test/ and others come at the end: not checked
        self.logged = objective.startswith(("val/", "test/"))

    def on_validation_end(self, loop: Any, metrics: dict, step: int) -> None:
        if not self.validated:
            self.validated = True
            _require_logged(metrics, "objective", self.objective, "at validation")

    def on_train_log(self, loop: Any, metrics: dict, step: int) -> None:
        if not self.logged:
            self.logged = True
            _require_logged({**loop.progress.metrics, **metrics}, "objective", self.objective, "while training")


class _Monitor:
    """A metric to watch at each validation, and which way is better."""

    def on_fit_start(self, loop: Any) -> None:
        if (loop.val is None or not loop.schedule.val_batches) and self.monitor.startswith("val/"):
            raise CallbackError(f"callbacks.{self.who}.monitor={self.monitor}, but this run never validates (no "
                                "val_dataset, or trainer.limit_val_batches=0)")

    def __init__(self, monitor: str, mode: Literal["min", "max"], who: str) -> None:
        if not (isinstance(monitor, str) and monitor):
            raise ValueError(f"callbacks.{who}.monitor={monitor!r} must name a metric, e.g. val/loss")
        if mode not in ("min", "max"):
            raise ValueError(f"callbacks.{who}.mode={mode!r} is not allowed: use min or max")
        self.monitor, self.mode, self.who = monitor, mode, who

    def better(self, value: float, than: Optional[float], margin: float = 0.0) -> bool:
        if than is None:
            return not math.isnan(value)
        return value < than - margin if self.mode == "min" else value > than + margin


class EarlyStopping(_Monitor):
    """Stop every process at the same step once `monitor` has not improved by `min_delta` for `patience`
    validations in a row. The run then saves last.ckpt and ends normally; metrics.json says why."""

    def __init__(self, monitor: str = "val/loss", mode: Literal["min", "max"] = "min", patience: int = 3,
                 min_delta: float = 0.0) -> None:
        super().__init__(monitor, mode, "early_stopping")
        if not (isinstance(patience, int) and patience >= 1):
            raise ValueError(f"callbacks.early_stopping.patience={patience} must be a positive number of validations")
        if not (isinstance(min_delta, (int, float)) and min_delta >= 0):
            raise ValueError(f"callbacks.early_stopping.min_delta={min_delta} must be >= 0")
        self.patience, self.min_delta = patience, float(min_delta)
        self.best: Optional[float] = None
        self.best_step, self.wait, self.stopped_step = -1, 0, -1

    def on_validation_end(self, loop: Any, metrics: dict, step: int) -> None:
        value = _monitored(metrics, self.monitor, self.who)
        if self.better(value, self.best, self.min_delta):
            self.best, self.best_step, self.wait = value, step, 0
        else:
            self.wait += 1
        # The values are reduced over processes, so every process decides alike; the vote makes sure.
        if loop.strategy.reduce_boolean_decision(self.wait >= self.patience, all=False):
            self.stopped_step = step
            loop.request_stop(f"early_stopping: {self.monitor} did not improve by more than {self.min_delta:g} "
                              f"for {self.wait} validation(s); best {self.best:.6g} at step {self.best_step}")

    def on_fit_end(self, loop: Any, result: dict) -> None:
        if self.stopped_step >= 0:
            result["early_stopping_step"] = self.stopped_step

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "wait": self.wait}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step, self.wait = state["best"], state["best_step"], state["wait"]


class ModelCheckpoint(_Monitor):
    """Keep the `save_top_k` best checkpoints by `monitor` (`checkpoints/best-step-N.ckpt`, -1: all) and
    `checkpoints/best.ckpt`, the best of all; only this run's own files are ever removed. It looks at each
    validation (`trainer.val_check_interval` sets how often); periodic saves are `trainer.ckpt_every_n_steps`,
    pruned by `trainer.keep_last_k`. metrics.json gets `best_model_score`, `best_step` and `best_model_path`."""

    def __init__(self, monitor: str = "val/loss", mode: Literal["min", "max"] = "min", save_top_k: int = 1) -> None:
        super().__init__(monitor, mode, "model_checkpoint")
        if not (isinstance(save_top_k, int) and save_top_k >= -1):
            raise ValueError(f"callbacks.model_checkpoint.save_top_k={save_top_k} is not allowed: use -1 (keep all), "
                             "0 (only best.ckpt) or a positive number of checkpoints")
        self.save_top_k = save_top_k
        self.kept: list[list] = []  # [score, step, file name], best first
        self.best: Optional[list] = None  # [score, step]

    def on_validation_end(self, loop: Any, metrics: dict, step: int) -> None:
        value = _monitored(metrics, self.monitor, self.who)
        folder = loop.run_dir / "checkpoints"
        if self.better(value, None if self.best is None else self.best[0]):
            self.best = [value, step]
            loop.save_checkpoint(folder / "best.ckpt")
        if self.save_top_k == 0 or math.isnan(value):
            return
        if self.save_top_k != -1 and len(self.kept) >= self.save_top_k and not self.better(value, self.kept[-1][0]):
            return
        name = f"best-step-{step:06d}.ckpt"
        ranked = sorted([*self.kept, [value, step, name]], key=lambda item: item[0], reverse=self.mode == "max")
        keep = len(ranked) if self.save_top_k == -1 else self.save_top_k
        self.kept, dropped = ranked[:keep], ranked[keep:]
        loop.save_checkpoint(folder / name)  # the state it holds already lists what is kept
        for _, _, old in dropped:  # files this run wrote and recorded: never another run's
            loop.remove_checkpoint(folder / old)

    def on_fit_end(self, loop: Any, result: dict) -> None:
        if self.best is not None:
            result.update(best_model_score=self.best[0], best_step=self.best[1],
                          best_model_path=str(loop.run_dir / "checkpoints" / "best.ckpt"))

    def state_dict(self) -> dict:
        return {"kept": [list(item) for item in self.kept], "best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.kept, self.best = [list(item) for item in state["kept"]], state["best"]


class ModelSummary:
    """Parameters (total and trainable) per top-level module of the model, in runner.log and HParams."""

    def on_fit_start(self, loop: Any) -> None:
        model = loop.strategy.unwrap(loop.wrapped).model
        rows = [(name or "(root)", *_count(child)) for name, child in model.named_children()] or [("(root)",
                                                                                                  *_count(model))]
        total, trainable = _count(model)
        loop.hparams.update({"model/params": total, "model/trainable_params": trainable})
        if loop.strategy.is_global_zero:
            width = max(len(name) for name, _, _ in rows)
            lines = [f"  {name:<{width}}  {n:>12,}  {t:>12,}" for name, n, t in rows]
            log.info("model %s: %s parameters, %s trainable\n  %s  %12s  %12s\n%s", type(model).__name__,
                     f"{total:,}", f"{trainable:,}", "module".ljust(width), "params", "trainable", "\n".join(lines))


def _count(module: Any) -> tuple[int, int]:
    params = list(module.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
