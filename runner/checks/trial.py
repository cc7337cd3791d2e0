"""The check stage's first batch: data.batch_size samples read as the loop's loader reads them (a stream's from its
iterator, never its len() or indexing), collated, and passed forward and backward through the model and task as the
first step passes them, or through a LightningModule's own training_step and validation_step; what fails is one line.

CLI → compose → validate → [dry run: the data, this trial, the report]. A small model of a CPU run runs on the CPU
(runner.build.trial_model), a batch whose FLOPs would cost more than CPU_BATCH_FLOPS there and a large model on the
meta device (shapes only: no memory, no initialisation). Never run in a training job: a stream read here would be
read again by the worker, and a one-pass stream would have lost its first samples.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterator, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from runner.build import model_data_mismatch, python_rng_kept, trial_model
from runner.config import ConfigError
from runner.plan import Plan
from runner.values import one_line

# FLOPs (forward and backward) of a first batch run on the CPU; above, the batch's shapes go through the meta device,
# whose machinery costs ~0.3 s of CPU to import once: about what this many FLOPs cost on one core.
CPU_BATCH_FLOPS = 5e9


@dataclass
class Trial:
    """What the trial ran (`tried`, for the report line) and the FLOPs per sample it counted (None: why not)."""

    tried: str
    gflop_per_sample: Optional[float] = None
    not_counted: str = ""


@dataclass
class FirstBatch:
    """A split's first batch as its loader would collate it: `batch` (`count` samples), and two of them (`pair`)."""

    batch: Any
    count: int
    pair: Any
    words: str  # "the first batch of data.batch_size=16 samples", "the first val_dataset batch of ...", ...
    stream_samples: Optional[list]  # a stream's samples as read (a map-style set's are read again by index)
    collate_fn: Any


def first_batch_trial(plan: Plan, data: Any) -> Trial:
    """The first batch of the training data through the model (or a LightningModule's steps); a ConfigError naming
    what failed. `data` None: a data module the check does not set up."""
    from runner.lightning import is_lightning_config

    cfg = plan.cfg
    lightning = is_lightning_config(cfg)
    if data is None:
        return Trial(f"{'its steps were not run' if lightning else 'no batch was tried'}: the data module is not set "
                     "up (stage=check_data sets it up)")
    with torch.random.fork_rng(devices=[]), python_rng_kept():  # a stream or a model may draw from them
        first = read_first_batch(cfg, data, "train")
        if first is None:
            return Trial("no batch was tried: train_dataset is empty")
        return lightning_trial(plan, data, first) if lightning else model_trial(plan, first)


def read_first_batch(cfg: DictConfig, data: Any, split: str) -> Optional[FirstBatch]:
    """The first batch of `data.<split>_dataset` (None without samples); what cannot be read or collated, and a
    training stream that ends before one batch, are a ConfigError."""
    from runner.data.streams import is_stream

    dataset = getattr(data, f"{split}_dataset", None)
    if dataset is None:
        return None
    batch_size, collate_fn, size_words = _loader_settings(data, split)
    what = f"data ({cfg.data._target_})"
    stream = is_stream(dataset)
    count = batch_size if stream else min(batch_size, len(dataset))
    try:
        samples = list(itertools.islice(iter(dataset), count)) if stream else _indexed(dataset, count)
    except Exception as error:  # noqa: BLE001 - the data's own code: its failure is the user's to fix
        raise ConfigError([f"{what}: reading the first {count} samples of {split}_dataset"
                           f"{' (a stream)' if stream else ''} fails: {one_line(error)}"]) from error
    if stream and split == "train" and len(samples) < batch_size:
        raise ConfigError([f"{what}: {split}_dataset (a stream) ended after {len(samples)} samples, fewer than one "
                           f"batch ({size_words}); training takes whole batches, so an epoch would train nothing"])
    count = len(samples) if stream else count
    if count == 0:
        return None
    batch = _collated(what, split, collate_fn, samples, count)
    pair = batch if count <= 2 else _collated(what, split, collate_fn, samples[:2] if isinstance(samples, list)
                                              else _indexed(dataset, 2), 2)
    which = "the first batch" if split == "train" else f"the first {split}_dataset batch"
    words = f"{which} of {size_words} samples" if count == batch_size else f"{which} (all {count} samples)"
    return FirstBatch(batch, count, pair, words, samples if stream else None, collate_fn)


def _loader_settings(data: Any, split: str) -> tuple[int, Any, str]:
    """The split's batch size, collate function and the words naming where the batch size comes from."""
    from runner.data import LoaderData, collate

    given = data.split_settings.get(split) if isinstance(data, LoaderData) else None
    if given:
        return given["batch_size"], given["collate_fn"], f"{split}_dataloader()'s batch_size={given['batch_size']}"
    return data.batch_size, getattr(data, "collate_fn", collate), f"data.batch_size={data.batch_size}"


def _indexed(dataset: Any, count: int) -> Any:
    """As the loader fetches: the whole batch at once where the data set can (`__getitems__`)."""
    indices = list(range(count))
    return dataset.__getitems__(indices) if hasattr(dataset, "__getitems__") else [dataset[i] for i in indices]


def _collated(what: str, split: str, collate_fn: Any, samples: Any, count: int) -> Any:
    from runner.data import collate

    try:
        return collate_fn(samples)
    except Exception as error:  # noqa: BLE001 - the data's samples or its collate_fn: the user's to fix
        how, fix = (("the default collate", "give the data a collate_fn that batches them") if collate_fn is collate
                    else ("its collate_fn", "fix data.collate_fn"))
        raise ConfigError([f"{what}: the first {count} samples of {split}_dataset do not form a batch with {how}: "
                           f"{one_line(error)}; {fix}"]) from error


def model_trial(plan: Plan, first: FirstBatch) -> Trial:
    """The batch forward and backward through the model and task, its FLOPs counted: on the CPU where trial_model
    builds the model there and the batch costs at most CPU_BATCH_FLOPS (two samples tell), else on the meta device."""
    from runner.flops import meta_twin

    cfg = plan.cfg
    if first.stream_samples is not None:  # a stream's first samples meet the model as a map-style set's do in
        problem = model_data_mismatch(  # build_data, with the same line
            cfg, SimpleNamespace(train_dataset=first.stream_samples, collate_fn=first.collate_fn))
        if problem:
            raise ConfigError([problem])
    model, device = trial_model(cfg)
    task = plan.task
    whole = first.words
    if device == "cpu":
        pair_flops = _run(cfg, model, task, first.pair, "2 samples", "on the CPU") if first.count > 2 else 0
        whole += ", where 2 samples pass," if first.count > 2 else ""
        if pair_flops is None or pair_flops / 2 * first.count <= CPU_BATCH_FLOPS:
            flops = _run(cfg, model, task, first.batch, whole, "on the CPU")
            return _counted(f"a first batch ({first.count} samples) ran forward and backward on the CPU", flops,
                            first.count)
        model = meta_twin(model)
    try:
        flops = _run(cfg, model, task, _on_meta(first.batch), whole, "on the meta device: shapes only")
    except _MetaCannot as cannot:
        return Trial(f"a first batch ({first.count} samples) was not tried: the model does not run on the meta "
                     f"device ({cannot})", None, "")
    return _counted(f"a first batch ({first.count} samples) went forward and backward on the meta device (shapes "
                    "only)", flops, first.count)


class _MetaCannot(Exception):
    """An operation the meta device cannot run (a value read with .item(), a data-dependent shape)."""


def _run(cfg: DictConfig, model: Any, task: Any, batch: Any, words: str, where: str) -> Optional[int]:
    """The FLOPs of `batch` (`words` says which) forward and backward through model and task (None: torch's counter
    fails where the model runs); a failure is a ConfigError naming the batch, the module that raised and the error
    (on the meta device, one of the device's own limits is _MetaCannot)."""
    from runner.flops import count_flops
    from runner.precision import Precision
    from runner.tasks import BatchError, TaskModule

    try:
        with located(model) as running:
            return count_flops(TaskModule(model, task, Precision()), batch, on_meta=False)
    except Exception as error:  # noqa: BLE001 - sorted below: the meta device's limits, the task's, the model's
        if where.startswith("on the meta") and (not isinstance(error, (RuntimeError, ValueError, IndexError,
                                                                       BatchError)) or "meta" in str(error).lower()):
            raise _MetaCannot(one_line(error)[:160]) from error
        if where == "on the CPU" and _runs_uncounted(model, task, batch):
            return None  # an operation torch's FLOP counter (a dispatch mode) does not take
        if isinstance(error, BatchError):
            line = f"task ({cfg.task._target_}) with data ({cfg.data._target_}) on {words}: {one_line(error)}"
        else:
            line = (f"model ({cfg.model._target_}) fails on {words.rstrip(',')} (forward and backward, {where})"
                    f"{in_module(running)}: {one_line(error)}")
        raise ConfigError([line]) from error


def _runs_uncounted(model: Any, task: Any, batch: Any) -> bool:
    """Whether `batch` goes forward and backward through model and task outside torch's FLOP counter."""
    import copy

    from runner.precision import Precision
    from runner.tasks import TaskModule

    try:
        TaskModule(model, copy.copy(task), Precision())(batch)["loss"].sum().backward()
    except Exception:  # noqa: BLE001 - it fails by itself: the caller reports the first failure
        return False
    return True


def _on_meta(batch: Any) -> Any:
    from runner.tree import apply_to_tensors

    return apply_to_tensors(batch, lambda t: t.to("meta"))


def _counted(tried: str, flops: Optional[int], count: int) -> Trial:
    if flops is None:
        return Trial(tried, None, "torch's FLOP counter does not run this model")
    if not flops:
        return Trial(tried, None, "no matrix products counted")
    return Trial(tried, flops / count / 1e9)


@contextlib.contextmanager
def located(model: Any) -> Iterator[list]:
    """While it lasts, the list it gives holds the (name, module) of the model's submodules whose forward is running,
    outermost first: after an error, where it was raised (the hooks pop only on a forward's return)."""
    running: list = []
    if not isinstance(model, torch.nn.Module):
        yield running
        return

    def returned(module: Any, args: Any, output: Any) -> None:  # None: a hook's value would replace the output
        running.pop()

    handles = []
    for name, module in model.named_modules():
        if name:
            try:
                entered = module.register_forward_pre_hook(
                    lambda module, args, name=name: running.append((name, module)) and None)
            except RuntimeError:  # a scripted module takes no hooks: its errors name no submodule
                continue
            handles += [entered, module.register_forward_hook(returned)]
    try:
        yield running
    finally:
        for handle in handles:
            handle.remove()


def in_module(running: list) -> str:
    """`, in net.features.0 (Conv2d)`: the innermost submodule that was running, or nothing (the model's own code)."""
    if not running:
        return ""
    name, module = running[-1]
    return f", in {name} ({type(module).__name__})"


def lightning_trial(plan: Plan, data: Any, first: FirstBatch) -> Trial:
    """A LightningModule of at most TRIAL_ON_CPU_PARAMETERS parameters, for a CPU run: its training_step (forward and
    backward, FLOPs counted) on the first training batch and validation_step on the first validation batch."""
    from runner.build import TRIAL_ON_CPU_PARAMETERS
    from runner.lightning.trial import NotTried, StepFailed, run_steps

    cfg = plan.cfg
    model, device = trial_model(cfg)
    if device != "cpu":
        kind = plan.accelerator.device_type
        why = (f"accelerator={kind}: they run on the CPU for a CPU run only" if kind != "cpu" else
               f"over {TRIAL_ON_CPU_PARAMETERS / 1e6:.3g}M parameters, they run in the workers only")
        return Trial(f"its training_step and validation_step were not run ({why})")
    val = read_first_batch(cfg, data, "val")
    try:
        with located(model) as running, _runner_log_quiet():  # the worker's lines on the module are not the check's
            flops, ran, val_names = run_steps(model, cfg, first.batch, val.batch if val is not None else None)
    except StepFailed as failed:
        batch = first if failed.step == "training_step" else val
        raise ConfigError([f"model ({cfg.model._target_}): {failed.step} fails on {batch.words}"
                           f"{in_module(running)}: {one_line(failed.error)}"]) from failed
    except NotTried as why:
        return Trial(f"its training_step and validation_step were not run: {why}")
    _check_objective_logged(cfg, val_names)
    tried = f"{' and '.join(ran) or 'no step'} ran on a first batch ({first.count} samples) on the CPU"
    if flops is None:
        return Trial(tried, None, "manual optimization: training_step steps the optimizers a worker gives it")
    return _counted(tried, flops, first.count)


def _check_objective_logged(cfg: DictConfig, val_names: Optional[set[str]]) -> None:
    """An objective set by the user that the LightningModule's validation does not log: the run would train up to its
    first validation and stop there. Not said where a callback of the user's may log it (pl_module.log in its
    on_validation_epoch_end), nor where the validation's names are not known."""
    from runner.callbacks import DEFAULT_OBJECTIVE

    objective = cfg.get("objective")
    own_callbacks = [name for name, node in (cfg.get("callbacks") or {}).items()
                     if not str(OmegaConf.select(node, "_target_", default="")).startswith("runner.")]
    if val_names is None or objective in (None, DEFAULT_OBJECTIVE) or objective in val_names or own_callbacks:
        return
    logged = ", ".join(sorted(val_names)) or "nothing"
    raise ConfigError([f"objective={objective} is not logged at validation by model ({cfg.model._target_}): its "
                       f"validation logs {logged}; set objective to one of them, or "
                       f"leave it unset (the run then ranks by the module's own monitor, if any)"])


@contextlib.contextmanager
def _runner_log_quiet() -> Iterator[None]:
    log = logging.getLogger("runner")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)
