"""A checkpoint to resume or evaluate from against the config: verified, data only, and fitting this run.

CLI → compose → [validate: this check, last, when the config passed every other one] → run folder → launch →
worker → build → loop → teardown. Nothing of the file is unpickled beyond tensors and plain containers; the
model and the optimizer it must fit are built on the meta device and over one parameter.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from omegaconf import DictConfig

from runner.build import probe_optimizer
from runner.lightning import is_lightning_config
from runner.plan import Plan
from runner.schedulers import unreachable


def check_checkpoint(plan: Plan) -> Iterator[str]:
    """The plan's checkpoint is the one written (its checksums), holds data only, a possible step, finite weights and
    this run's task, and fits this config: the model's tensors and the position in the epoch."""
    from runner.checkpoint_io import CheckpointError

    cfg, processes, path = plan.cfg, plan.processes, plan.ckpt_path
    last_step = _last_step(cfg)
    try:
        checkpoint = _read_checked(plan, path)
    except CheckpointError as err:
        yield f"trainer.ckpt_path={path}: {err}"
        return
    missing = [key for key in ("model", "optimizer", "step") if key not in checkpoint]
    if missing:
        from runner.checkpoint_io.formats import WEIGHTS_ALONE, foreign_format

        foreign = foreign_format(path)
        yield (f"trainer.ckpt_path={path} is not a runner checkpoint: it lacks {', '.join(missing)}"
               + (f"; it is {foreign}: {WEIGHTS_ALONE}" if foreign else ""))
        return
    per_step = cfg.data.get("batch_size", 1) * processes * cfg.trainer.accumulate_grad_batches
    samples = checkpoint.get("samples_in_epoch", 0)
    # Other stages, and trainer.resume=weights, take the weights only: no data position, optimizer or schedule.
    resume = cfg.trainer.get("resume", "exact") if cfg.get("stage", "fit") == "fit" else "weights"
    if samples % per_step and resume != "weights":
        # The first step would train on part of a global batch (or skip samples): the data would not continue.
        yield (f"trainer.ckpt_path={path} stopped {samples} samples into an epoch, not a whole number of this "
               f"run's global batches (data.batch_size x processes x trainer.accumulate_grad_batches = {per_step}); "
               f"resume with its global batch ({checkpoint.get('global_batch_size')})")
    yield from _check_model_fits(plan, path, checkpoint["model"])
    if resume != "weights" and not is_lightning_config(cfg):  # a LightningModule's configure_optimizers() chooses
        yield from _check_optimizer_state(cfg, path, checkpoint["optimizer"])
    if resume == "exact" and not is_lightning_config(cfg):  # a LightningModule's configure_optimizers() makes its own
        yield from _check_same_scheduler(cfg, path, checkpoint)
    if resume == "exact" and last_step is not None:
        problem = unreachable(checkpoint, last_step, path)
        yield from [problem] if problem else []


def _last_step(cfg: DictConfig) -> Any:
    """The step a fit ends at, where trainer.max_steps alone decides it (else the worker, which counts the data's
    steps, checks the schedule against it)."""
    t = cfg.trainer
    alone = t.max_steps != -1 and t.max_epochs in (None, -1) and not t.fast_dev_run
    return t.max_steps if alone and cfg.get("stage", "fit") == "fit" else None


def _check_same_scheduler(cfg: DictConfig, path: Any, checkpoint: dict) -> Iterator[str]:
    """An exact resume continues the checkpoint's schedule: another scheduler or other settings are one line
    naming both (older checkpoints record none; the worker refuses another scheduler's state)."""
    from omegaconf import OmegaConf

    from runner.loggers.tracking import flatten
    from runner.schedulers import configured, schedule_change

    saved = checkpoint.get("schedule")
    if not isinstance(saved, dict) or not isinstance(saved.get("scheduler"), dict):
        return
    mine = configured(flatten(OmegaConf.to_container(cfg.scheduler, resolve=True), "scheduler."))
    problem = schedule_change(saved["scheduler"], mine, path, checkpoint.get("step"))
    if problem:
        yield problem


def _read_checked(plan: Plan, path: Any) -> dict:
    """The checkpoint at `path` verified and checked (CheckpointError otherwise); a sharded folder's tensors on
    the meta device, its weights checked one stored chunk at a time. Nothing of it is unpickled beyond data."""
    from runner.checkpoint_io import CheckpointError, TorchCheckpointIO, sharded, trust

    cfg = plan.cfg
    # Without checksums only a checkpoint the user names: `last`/`best` may find any folder under outputs/.
    wanted = bool(cfg.trainer.get("trust_unchecked_checkpoint", False))
    trusted = wanted and cfg.trainer.ckpt_path not in ("last", "best")
    try:
        task = trust.task_name(plan.task)
    except Exception:  # noqa: BLE001 - a task that cannot be built is reported by the task checks
        task = None
    try:
        if sharded.is_sharded(path):
            checkpoint = sharded.skeleton(path, trusted)
            trust.check(path, checkpoint, task, nonfinite=sharded.nonfinite_weights(path))
        else:
            checkpoint = trust.load_file(TorchCheckpointIO(), path, trusted)
            trust.check(path, checkpoint, task)
    except CheckpointError as error:
        if wanted and not trusted and "checksum" in str(error):
            raise CheckpointError(f"{error} (trainer.trust_unchecked_checkpoint=true is not taken for "
                                  f"trainer.ckpt_path={cfg.trainer.ckpt_path}, which may find any run's folder: "
                                  f"name this one, trainer.ckpt_path={path})") from None
        raise
    return checkpoint


def _check_optimizer_state(cfg: DictConfig, path: Any, saved: Any) -> Iterator[str]:
    """The configured optimizer keeps the per-parameter state the checkpoint holds (SGD's is not AdamW's).

    One step of the configured optimizer over one parameter says what it keeps; this imports torch._dynamo,
    which only a resumed run pays here (and an in-process run pays anyway for its first optimizer).
    """
    state = saved.get("state") if isinstance(saved, dict) else None
    if not state:
        return
    try:
        optimizer = probe_optimizer(cfg.optimizer, [torch.zeros(1, requires_grad=True)])
        if optimizer is None:
            return
        (parameter,) = optimizer.param_groups[0]["params"]
        parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
    except Exception:  # noqa: BLE001 - an optimizer that needs more than this probe is checked when it loads
        return
    expected, found = set(optimizer.state[parameter]), set(next(iter(state.values())))
    if not expected <= found:
        yield (f"trainer.ckpt_path={path} holds the state of another optimizer: optimizer={cfg.optimizer._target_} "
               f"keeps {', '.join(sorted(expected))} per parameter, the checkpoint {', '.join(sorted(found))}; "
               "resume with the optimizer it was saved with")


def _eager(name: str) -> str:
    """A parameter's name without torch.compile's wrapper: a module that compiles a part of itself in setup() (which
    the meta build does not run) saves `net._orig_mod.weight` for the `net.weight` built here."""
    return name.replace("._orig_mod.", ".").removeprefix("_orig_mod.")


def _check_model_fits(plan: Plan, path: Any, saved: dict) -> Iterator[str]:
    cfg, model = plan.cfg, plan.meta_model  # shapes only: no memory, no initialisation cost
    try:
        expected = {_eager(k): tuple(v.shape) for k, v in model.state_dict().items()}
    except Exception:  # noqa: BLE001 - a model that cannot be built on the meta device is checked when loaded
        return
    found = {_eager(k): tuple(v.shape) for k, v in saved.items()}
    differ = [f"{k} {found[k]} vs {shape}" for k, shape in expected.items() if k in found and found[k] != shape]
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if not cfg.trainer.get("strict_loading", True) or getattr(model, "strict_loading", True) is False:
        missing, extra = [], []  # loaded without them, listed when the worker loads it
    if differ or missing or extra:
        details = "; ".join(filter(None, [
            differ and "shapes (checkpoint vs model) " + ", ".join(differ[:3]),
            missing and "missing " + ", ".join(missing[:3]),
            extra and "unexpected " + ", ".join(extra[:3]),
        ]))
        loose = "" if differ else " (trainer.strict_loading=false loads it without the keys either side lacks)"
        yield f"trainer.ckpt_path={path} holds another model than model={cfg.model.get('_target_')}: {details}{loose}"
