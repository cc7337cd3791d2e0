"""What a job does with its loop: `stage=fit` (then test, when the data has a test set), validate, test, predict."""

from __future__ import annotations

import itertools
import logging
import math
import signal
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from runner.checkpoint_io import TorchCheckpointIO
from runner.config import ConfigError
from runner.data import close_loaders, ready, val_loader
from runner.loggers import media
from runner.loop.progress import loader_length
from runner.loop.stop import BatchVote
from runner.values import is_int

log = logging.getLogger("runner")
STAGES = ("fit", "validate", "test", "predict")
_STRATEGY_NAMES = {"SingleDeviceStrategy": "single", "DataParallelStrategy": "dp", "DDPStrategy": "ddp",
                   "FSDPStrategy": "fsdp"}


def run_info(strategy: Any, num_nodes: int) -> dict:
    """What ran where: the device type and name, devices per node, nodes, each process's CPU threads,
    process-group backend, precision, processes and strategy."""
    device = strategy.root_device
    return {
        "accelerator": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "devices_per_node": len(getattr(strategy, "parallel_devices", None) or [device]),
        "num_nodes": num_nodes,
        "num_threads": torch.get_num_threads(),
        "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else "none",
        "precision": getattr(strategy.precision, "precision", "32-true"),
        "world_size": strategy.world_size,
        "strategy": _STRATEGY_NAMES.get(type(strategy).__name__, type(strategy).__name__),
    }


def run_line(info: dict) -> str:
    """`devices: 2 × cpu (gloo), 1 thread per process, precision 32-true, world size 2, strategy ddp`, with the GPU's
    name on CUDA."""
    name = f" {info['device_name']}" if info["accelerator"] == "cuda" else ""
    nodes = f" × {info['num_nodes']} nodes" if info["num_nodes"] > 1 else ""
    backend = "no process group" if info["backend"] == "none" else info["backend"]
    threads = f"{info['num_threads']} thread{'s' if info['num_threads'] != 1 else ''}" + (
        " per process" if info["world_size"] > 1 else "")
    return (f"devices: {info['devices_per_node']} × {info['accelerator']}{name}{nodes} ({backend}), {threads}, "
            f"precision {info['precision']}, world size {info['world_size']}, strategy {info['strategy']}")


def record_dir(stage: str, run_dir: Path) -> Path:
    """Where a stage writes its record: its run folder; a stage other than fit run in a fit's folder (one that holds
    checkpoints/, e.g. `stage=test trainer.ckpt_path=best` there) writes in a folder of its own inside it, so that
    the fit's metrics.json, .hydra/resolved.yaml and tensorboard/ (what `best` and `last` are found by) stay the
    fit's."""
    if stage in ("fit", "check", "check_data") or not (run_dir / "checkpoints").is_dir():
        return run_dir
    own = run_dir / stage
    log.info("stage=%s in the folder of a fit (%s): its record (metrics.json, logs) goes to %s; the fit's stays as "
             "it is", stage, run_dir, own)
    return own


def dev_run_only(callbacks: Any, batches: int, announce: bool) -> None:
    """`trainer.fast_dev_run`: as Lightning's, no checkpoint or early-stopping callbacks (and the worker builds no
    logger); each loop runs `batches` batches."""
    from runner.callbacks import EarlyStopping, ModelCheckpoint

    dropped = [name for name, c in callbacks.by_name.items() if isinstance(c, (ModelCheckpoint, EarlyStopping))]
    for name in dropped:
        del callbacks.by_name[name]
    if announce:
        log.info("trainer.fast_dev_run: %d batch(es) of training, validation, test and predict per process; no "
                 "checkpoints, no loggers%s", batches, f", callbacks {', '.join(dropped)} off" if dropped else "")


def _dev_batches(loop: Any, split: str = "test") -> float:
    """The batches each evaluation loop runs: trainer.fast_dev_run's, trainer.limit_<split>_batches' number, or all."""
    limit = loop.cfg.get(f"limit_{split}_batches", 1.0)
    return int(loop.cfg.fast_dev_run) or (limit if is_int(limit) else math.inf)


def _loader(loop: Any, data: Any, split: str, stage: str) -> Any:
    loader = val_loader(data, loop.strategy.distributed_sampler_kwargs, loop.cfg.seed, split)
    if loader is None:
        raise missing_split(data, split, stage)
    return loader


def missing_split(data: Any, split: str, stage: str) -> ConfigError:
    name = type(getattr(data, "source", data)).__name__  # a data module's own class, not its LoaderData
    return ConfigError([f"stage={stage} needs a {split}_dataset, but the data ({name}) has none or an empty one; "
                        f"give the data object a {split}_dataset attribute (or a {split}_dataloader() method)"])


def fit(loop: Any, data: Any) -> dict:
    """Train; then, when the data has a test set (a data module's after its setup("test")), test the best
    checkpoint (else the last weights)."""
    result = loop.run()
    if result.get("stop_signal"):  # stopped to resume later; a callback's stop (early stopping) is an end
        if loop.strategy.is_global_zero and _may_test(data):
            log.warning("the test after training is skipped: training was stopped by %s (a resumed run that "
                        "ends tests)", signal.Signals(result["stop_signal"]).name)
        return result
    test = val_loader(ready(data, "test"), loop.strategy.distributed_sampler_kwargs, loop.cfg.seed, "test")
    if test is None:
        return result
    best = result.get("best_model_path")
    if best:
        # With checkpoint_io=async rank 0 may still be writing best.ckpt; every rank reads it after that.
        getattr(loop.strategy.checkpoint_io, "wait", lambda: None)()
        loop.strategy.barrier("best checkpoint written")
        loop.load_weights(loop.strategy.load_checkpoint(best))
    log.info("testing %s", best or "the last weights")
    result.update(loop.evaluate("test", test, _dev_batches(loop, "test")), tested=best or "last")
    if result.get("stop_signal"):  # the training is whole; the test alone was cut short
        result["stopped_in"] = "test after training"
    loop.write_result(result)
    return result


def _may_test(data: Any) -> bool:
    """Whether the data has, or may make in its setup("test"), a test set (not called here: it may be heavy)."""
    source = getattr(data, "source", data)
    return any(getattr(source, name, None) is not None for name in ("test_dataset", "test_dataloader", "setup"))


def evaluate(split: str) -> Callable[[Any, Any], dict]:
    def run(loop: Any, data: Any) -> dict:
        if split == "val":
            _refuse_no_validation(loop.cfg)
        loader = _loader(loop, data, split, "validate" if split == "val" else split)
        metrics = loop.evaluate(split, loader, _dev_batches(loop, split))
        result = {**metrics, "step": loop.progress.step, "epoch": loop.progress.epoch}
        if metrics.get("stop_signal"):
            result["stopped_in"] = f"stage={'validate' if split == 'val' else split}"
        loop.write_result(result)
        return result
    return run


def _refuse_no_validation(t: Any) -> None:
    """`trainer.limit_val_batches=0` turns validation off, as in Lightning (whose validate() then returns no metrics
    and says nothing): with stage=validate, whose only product is validation metrics, it is refused rather than
    ending as a success that validated nothing (an experiment that turns off validation during fit, reused)."""
    if t.limit_val_batches == 0 and not t.fast_dev_run:  # fast_dev_run's one batch overrides the limits
        raise ConfigError([f"trainer.limit_val_batches={t.limit_val_batches} with stage=validate validates nothing: "
                           "0 turns validation off; to validate, drop it or set trainer.limit_val_batches=1.0 (all "
                           "batches)"])


def predict(loop: Any, data: Any) -> dict:
    """`predictions.pt` in the run folder: {"predictions": one entry per sample, in the data set's order}
    (a tensor when every sample's prediction has one shape, else a list), loadable with weights_only=True.

    A stop signal ends the pass at a batch every process reaches (as a test's): nothing is written, since part of
    the predictions would read as all of them, and the job exits as stopped."""
    loader, limit = _loader(loop, data, "predict", "predict"), _dev_batches(loop, "predict")
    length = loader_length(loader)  # a stream that does not say: no count to vote over before its end
    vote = BatchVote(loop.strategy, loop.stop_vote.requested, min(limit, length) if length < math.inf else math.inf)
    try:
        predictions = loop.predict(_voted(loader if limit == math.inf else itertools.islice(loader, int(limit)),
                                          vote))
    finally:
        close_loaders(loader)  # its workers end now, not in a join at exit
    signalled = vote.final()
    path = Path(loop.run_dir) / "predictions.pt"
    if signalled:
        log.warning("predict stopped by %s after %d predictions on this process; predictions.pt is not written",
                    signal.Signals(signalled).name, len(predictions))
        result = {"step": loop.progress.step, "stop_signal": signalled, "stopped_in": "stage=predict"}
        loop.write_result(result)
        return result
    if loop.strategy.is_global_zero:
        same = len({tuple(p.shape) for p in predictions}) == 1
        stacked = torch.stack(predictions) if same else predictions
        TorchCheckpointIO().save_checkpoint({"predictions": stacked}, path)  # atomic, and written when it returns
        log.info("wrote %d predictions to %s", len(predictions), path)
    loop.strategy.barrier("predict")
    result = {"step": loop.progress.step, "predictions": str(path), "num_predictions": len(predictions)}
    loop.write_result(result)
    return result


def _voted(batches: Iterable[Any], vote: Any) -> Iterator[Any]:
    """`batches` until the processes agree on a stop (asked before each batch, as an evaluation asks)."""
    for index, batch in enumerate(batches):
        if vote(index):
            return
        yield batch


def _with_media(run: Callable[[Any, Any], dict]) -> Callable[[Any, Any], dict]:
    """The stage, with runner.loggers.log_image (and the other media functions) logging to its loggers."""
    def stage(loop: Any, data: Any) -> dict:
        with media.active(loop.logger, lambda: loop.progress.step):
            return run(loop, data)
    return stage


RUN: dict[str, Callable[[Any, Any], dict]] = {
    name: _with_media(run) for name, run in (("fit", fit), ("validate", evaluate("val")), ("test", evaluate("test")),
                                             ("predict", predict))}
