"""Callbacks: hooks around the fixed loop (the `callbacks` group), and the built-in ones.

A callback is any class with some of the hooks below; each hook is called on every process with the loop
and what it just did. Metrics passed to hooks are already reduced over processes, so every process sees
the same values; decisions that must agree still go through `loop.strategy` (reduce_boolean_decision),
and files are written through `loop.save_checkpoint` and removed through `loop.remove_checkpoint`, which
act on rank 0. A callback with `state_dict()`/`load_state_dict()` has its state in every checkpoint.

Hooks: on_fit_start(loop), on_train_log(loop, metrics, step), on_validation_end(loop, metrics, step),
on_save_checkpoint(loop, checkpoint) (before a save: may add to the dict), on_checkpoint_saved(loop, path),
on_fit_end(loop, result) (may add to the final result written to metrics.json), on_exception(loop, error);
per step and per batch:
- on_before_optimizer_step(loop, optimizer): once per optimizer step, the gradients of the whole step (every
  micro-batch accumulated, synced over processes, unscaled by the precision), before clipping and the step;
  not called for a step skipped as non-finite (trainer.skip_nonfinite_loss).
- on_train_batch_end(loop, outputs, step): after the optimizer and scheduler steps; `outputs` lists the
  micro-batches' output dicts ("loss": the micro-batch's loss summed over its units, "stats"), `step` the
  optimizer steps taken, the step its logs and checkpoint carry.
- on_validation_start(loop), on_validation_batch_end(loop, out, batch_index), on_validation_epoch_end(loop):
  around each validation (during fit and stage=validate; not a test), `out` a batch's output dict ("stats",
  and "preds"/"target" when a metric wants them); on_validation_epoch_end after the last batch, whether or
  not it had samples, before the metrics are reduced and on_validation_end gets them.
Which callbacks implement a hook is found once, so a hook nobody implements costs nothing per step.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Literal, Optional

import torch

from runner.errors import CallbackError, HookFailed, is_user_error
from runner.processes import peer_gone

log = logging.getLogger("runner")
HOOKS = ("on_fit_start", "on_train_log", "on_validation_end", "on_save_checkpoint", "on_checkpoint_saved",
         "on_fit_end", "on_exception", "on_before_optimizer_step", "on_train_batch_end", "on_validation_start",
         "on_validation_batch_end", "on_validation_epoch_end")


class _ByName(dict):
    """The callbacks by name; adding or removing one (the heartbeat adds itself) drops the owner's hook table."""

    def __init__(self, callbacks: dict[str, Any], changed: Callable[[], None]) -> None:
        super().__init__(callbacks)
        self.changed = changed


def _dropping_table(name: str) -> Callable:
    method = getattr(dict, name)

    def change(self: _ByName, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        self.changed()
        return result
    return change


for _name in ("__setitem__", "__delitem__", "pop", "popitem", "setdefault", "update", "clear"):
    setattr(_ByName, _name, _dropping_table(_name))


class Callbacks:
    """The configured callbacks by name; calling a hook calls it on each callback that has it, in order.

    Which callbacks have a hook is looked up once per hook (not per call), so `call` of a hook nobody has
    is one dict look-up, and `has` lets a hot path skip building the hook's arguments."""

    def __init__(self, callbacks: Optional[dict[str, Any]] = None) -> None:
        self._table: dict[str, tuple[Callable, ...]] = {}
        self.by_name = _ByName(callbacks or {}, self._table.clear)

    def methods(self, hook: str) -> tuple[Callable, ...]:
        """The bound `hook` methods of the callbacks that have it, in order."""
        found = self._table.get(hook)
        if found is None:
            found = self._table[hook] = tuple(_named(name, hook, callback, method)
                                              for name, callback in self.by_name.items()
                                              if callable(method := getattr(callback, hook, None)))
        return found

    def has(self, hook: str) -> bool:
        return bool(self.methods(hook))

    def call(self, hook: str, *args: Any) -> None:
        for method in self.methods(hook):
            method(*args)

    def state_dict(self) -> dict[str, Any]:
        return {name: c.state_dict() for name, c in self.by_name.items() if hasattr(c, "state_dict")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, callback in self.by_name.items():
            if name in state and hasattr(callback, "load_state_dict"):
                callback.load_state_dict(state[name])


def _named(name: str, hook: str, callback: Any, method: Callable) -> Callable:
    """A user's callback's `method`, where what it raises is one line naming the callback and the hook (the
    traceback in the log files); the runner's own callbacks, and the runner's own errors, pass as they are."""
    if type(callback).__module__.split(".")[0] == "runner":
        return method
    label = f"callbacks.{name}.{hook}()"

    def call(*args: Any) -> Any:
        try:
            return method(*args)
        except Exception as error:  # noqa: BLE001 - any failure of the user's hook is that hook's
            failure = _failed(label, error)
            if failure is error:
                raise
            raise failure from error
    return call


def _failed(label: str, error: Exception) -> Exception:
    # Another rank gone under a collective is that rank's story; a stop or a config error already says it all.
    return error if is_user_error(error) or peer_gone(error) else HookFailed(label, error)


def _require_logged(metrics: dict, setting: str, name: str, when: str) -> None:
    """A metric a setting names (a callback's monitor, the objective) must be among those the run logs."""
    if name not in metrics:
        logged = ", ".join(sorted(k for k in metrics if "/" in k)) or "none"
        raise CallbackError(f"{setting}={name} is not logged {when}; the metrics are: {logged}")


def _monitored(metrics: dict, monitor: str, who: str) -> float:
    _require_logged(metrics, f"callbacks.{who}.monitor", monitor, "at validation")
    return float(metrics[monitor])


# The `objective` a run gets when none is set (schemas.RunnerConfig): required only when the user sets it.
DEFAULT_OBJECTIVE = "val/loss"


class ObjectiveCheck:
    """The job's `objective` (what a sweep optimises, what the summary ranks) must be a metric the run logs; its
    best over the run's validations, by `direction`, is the result's `best`: {metric, value, step}.

    Checked where it first could be: a `val/` objective at the first validation, any other at the first training
    log, so a misspelt name stops the run there instead of every job of a sweep training for nothing. The default
    (val/loss, which the user did not choose) stops nothing: a run that does not log it ranks by a monitor of its
    own (a callback's `monitor`, the `monitors` its scheduler watches, such as a LightningModule's lr_scheduler
    monitor), said in one line, or has no objective.
    """

    def __init__(self, objective: str, direction: Literal["minimize", "maximize"] = "minimize",
                 chosen: Optional[bool] = None) -> None:
        self.objective: Optional[str] = objective
        self.direction = direction
        self.chosen = objective != DEFAULT_OBJECTIVE if chosen is None else chosen
        self.validated = not objective.startswith("val/")  # test/ and others come at the end: not checked
        self.logged = objective.startswith(("val/", "test/"))
        self.best: Optional[list] = None  # [value, step]
        self.own: list[tuple[str, str, str]] = []  # the run's own monitors: (metric, direction, whose)

    def on_fit_start(self, loop: Any) -> None:
        if self.chosen:
            return
        for name, callback in loop.callbacks.by_name.items():
            monitor = getattr(callback, "monitor", None)
            if isinstance(monitor, str) and monitor and not getattr(callback, "follows_objective", False):
                mode = getattr(callback, "mode", "min")
                self.own.append((monitor, "maximize" if mode == "max" else "minimize", f"callbacks.{name}.monitor"))
        self.own += list(getattr(loop.scheduler, "monitors", ()))

    def on_validation_end(self, loop: Any, metrics: dict, step: int) -> None:
        if not self.validated:
            self.validated = True
            if self.chosen or self.objective in metrics:
                _require_logged(metrics, "objective", self.objective, "at validation")
            else:
                self._own_objective(loop, metrics)
        value = metrics.get(self.objective) if self.objective is not None else None
        if not isinstance(value, (int, float)) or math.isnan(value):
            return
        if self.best is None or (value < self.best[0] if self.direction == "minimize" else value > self.best[0]):
            self.best = [float(value), step]

    def _own_objective(self, loop: Any, metrics: dict) -> None:
        """The default objective is not logged: the first of the run's own monitors that is, else none."""
        default, logged = self.objective, ", ".join(sorted(k for k in metrics if "/" in k)) or "none"
        found = next((own for own in self.own if own[0] in metrics), None)
        self.objective = found[0] if found else None
        say = log.info if found else log.warning
        if loop is None or loop.strategy.is_global_zero:
            say("objective=%s (the default, not set) is not logged at validation: %s; set objective=<metric> to "
                "choose (the metrics are: %s)", default,
                f"this run's objective is {found[0]} ({found[1]}), its {found[2]}" if found
                else "this run has no objective (metrics.json gets no best)", logged)
        if found is None:
            return
        self.direction = found[1]  # type: ignore[assignment]
        for callback in loop.callbacks.by_name.values() if loop is not None else ():
            if getattr(callback, "follows_objective", False):  # a monitor left unset follows the objective
                callback.monitor, callback.mode = found[0], "max" if found[1] == "maximize" else "min"

    def on_fit_end(self, loop: Any, result: dict) -> None:
        if self.best is not None and self.objective is not None:
            result["best"] = {"metric": self.objective, "value": self.best[0], "step": self.best[1]}

    def state_dict(self) -> dict:
        return {"best": self.best, "metric": self.objective}

    def load_state_dict(self, state: dict) -> None:
        # The best of another metric (a run that ranked by its own monitor, resumed with an objective set) is none.
        self.best = state["best"] if state.get("metric", self.objective) == self.objective else None

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

    def finite(self, loop: Any, value: float, step: int, consequence: str) -> bool:
        """Whether `value` can count; a NaN or inf one is said once per validation (every process has the same)."""
        if math.isfinite(value):
            return True
        if loop.strategy.is_global_zero:
            log.warning("%s: %s is %s at step %d: %s", self.who, self.monitor, value, step, consequence)
        return False


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
        counts = self.finite(loop, value, step, f"counts as no improvement ({self.wait + 1} of patience "
                                                f"{self.patience})")
        if counts and self.better(value, self.best, self.min_delta):
            self.best, self.best_step, self.wait = value, step, 0
        else:
            self.wait += 1
        # The values are reduced over processes, so every process decides alike; the vote makes sure.
        if loop.strategy.reduce_boolean_decision(self.wait >= self.patience, all=False):
            self.stopped_step = step
            best = (f"best {self.best:.6g} at step {self.best_step}" if self.best is not None
                    else "it was never finite")
            loop.request_stop(f"early_stopping: {self.monitor} did not improve by more than {self.min_delta:g} "
                              f"for {self.wait} validation(s); {best}")

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
        self.not_finite: list = []  # this run's validations whose value was NaN or inf: [value, step]

    def on_validation_end(self, loop: Any, metrics: dict, step: int) -> None:
        value = _monitored(metrics, self.monitor, self.who)
        if not self.finite(loop, value, step, "not a candidate for best.ckpt"):  # inf would be best for good
            self.not_finite.append([value, step])
            return
        folder = loop.run_dir / "checkpoints"
        if self.better(value, None if self.best is None else self.best[0]):
            self.best = [value, step]
            loop.save_checkpoint(folder / "best.ckpt")
        if self.save_top_k == 0:
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
        elif self.not_finite and loop.strategy.is_global_zero:
            value, step = self.not_finite[-1]
            log.warning("model_checkpoint: best.ckpt was not written: %s was not finite at any of this run's %d "
                        "validation(s) (last %s at step %d)", self.monitor, len(self.not_finite), value, step)

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


class EMA:
    """An exponential moving average of the model's weights: after every `every_n_steps`-th optimizer step,
    average = decay * average + (1 - decay) * weights, for each floating parameter (buffers such as BatchNorm's
    statistics stay the model's own); kept in float32 for 16-bit parameters.

    Validation during training runs on the average: it is copied into the model at on_validation_start and the
    model's own weights back at on_validation_epoch_end, before on_validation_end (so best.ckpt and every other
    checkpoint hold the trained weights under "model"). The average is in each checkpoint under
    callbacks.ema.weights, keyed as the model's state_dict, so a resumed run continues it exactly and
    `model.load_state_dict(checkpoint["callbacks"]["ema"]["weights"], strict=False)` loads it. Every process
    keeps the whole average (DDP's weights are the same on all); strategy=fsdp's sharded parameters are refused.
    """

    def __init__(self, decay: float = 0.999, every_n_steps: int = 1) -> None:
        if isinstance(decay, bool) or not (isinstance(decay, (int, float)) and 0 < decay < 1):
            raise ValueError(f"callbacks.ema.decay={decay!r} must be a number between 0 and 1, e.g. 0.999")
        if isinstance(every_n_steps, bool) or not (isinstance(every_n_steps, int) and every_n_steps >= 1):
            raise ValueError(f"callbacks.ema.every_n_steps={every_n_steps!r} must be a positive number of steps")
        self.decay, self.every_n_steps = float(decay), every_n_steps
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []  # the model's parameters, detached (they follow in-place updates)
        self.weights: list[torch.Tensor] = []  # the averages, in the order of `params`
        self._loaded: dict[str, torch.Tensor] = {}  # a checkpoint's averages, taken up at on_fit_start
        self._trained: list[torch.Tensor] = []  # the model's own weights while the averages are swapped in

    SHARDED = ("callbacks.{name} is not available with strategy=fsdp: its parameters are sharded over the processes; "
               "use strategy=ddp (every process holds the whole model)")

    def on_fit_start(self, loop: Any) -> None:
        model = loop.strategy.unwrap(loop.wrapped).model
        named = [(name, p) for name, p in model.named_parameters() if p.is_floating_point()]
        if any(hasattr(p, "to_local") for _, p in named):
            raise CallbackError(EMA.SHARDED.format(name="ema"))
        if self._loaded and set(self._loaded) != {name for name, _ in named}:
            raise CallbackError("trainer.ckpt_path: the checkpoint's callbacks.ema.weights are not of this model's "
                                f"parameters ({len(self._loaded)} saved, {len(named)} in the model)")
        self.names = [name for name, _ in named]
        self.params = [p.detach() for _, p in named]
        self.weights = [self._loaded.get(name, p).detach().to(p.device, _ema_dtype(p), copy=True) for name, p in named]
        self._loaded = {}

    def on_train_batch_end(self, loop: Any, outputs: list, step: int) -> None:
        if step % self.every_n_steps == 0:
            sources = [p.to(w.dtype) for p, w in zip(self.params, self.weights)]  # no copy where dtypes agree
            torch._foreach_lerp_(self.weights, sources, 1.0 - self.decay)

    def on_validation_start(self, loop: Any) -> None:
        if self.weights:  # none before training (stage=validate evaluates the checkpoint's own weights)
            self._trained = [p.clone() for p in self.params]
            torch._foreach_copy_(self.params, [w.to(p.dtype) for p, w in zip(self.params, self.weights)])

    def on_validation_epoch_end(self, loop: Any) -> None:
        if self._trained:
            torch._foreach_copy_(self.params, self._trained)
            self._trained = []

    def state_dict(self) -> dict:
        return {"decay": self.decay, "weights": dict(zip(self.names, self.weights))}

    def load_state_dict(self, state: dict) -> None:
        self._loaded = dict(state["weights"])


def _ema_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


class GradNorm:
    """`train/grad_norm`: the total 2-norm of an optimizer step's gradients before clipping (accumulated over the
    step's micro-batches and synced over processes), logged at the steps trainer.log_every_n_steps divides and at
    trainer.max_steps; a run that stops elsewhere has no train/grad_norm in metrics.json.

    It is taken on those steps only, as a device tensor (with trainer.gradient_clip_val set, the norm clipping
    computes), and read at the step's train log, where the loop syncs anyway: no host sync on other steps.
    """

    def __init__(self) -> None:
        self.norms: dict[int, Optional[torch.Tensor]] = {}  # log step -> its norm, until the log

    def on_before_optimizer_step(self, loop: Any, optimizer: Any) -> None:
        step = loop.progress.step + 1  # the step being taken
        if step % loop.schedule.log_every == 0 or step == loop.schedule.max_steps:  # the last step logs too
            clipped = loop.train_step.clip is not None  # the step's own clipping computes it next
            self.norms[step] = None if clipped else _total_norm(loop.task.parameters())

    def on_train_batch_end(self, loop: Any, outputs: list, step: int) -> None:
        if step in self.norms and self.norms[step] is None:
            self.norms[step] = loop.train_step.grad_norm

    def on_train_log(self, loop: Any, metrics: dict, step: int) -> None:
        norm = self.norms.pop(step, None)
        self.norms = {s: n for s, n in self.norms.items() if s > step}
        if norm is None:  # a log off the grid (a stop): no norm of this window's steps, so no stale one either
            loop.progress.metrics.pop("train/grad_norm", None)
            return
        value = float(getattr(norm, "full_tensor", lambda: norm)())  # a sharded (FSDP) norm: gathered
        metrics["train/grad_norm"] = loop.progress.metrics["train/grad_norm"] = value
        loop.logger.log_metrics({"train/grad_norm": value}, step)


def _total_norm(parameters: Any) -> torch.Tensor:
    with_grads = [p for p in parameters if p.grad is not None]
    total = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if total is not None:
        return total([p.grad for p in with_grads])
    return torch.nn.utils.clip_grad_norm_(with_grads, math.inf)  # clipping at inf leaves the gradients as they are
