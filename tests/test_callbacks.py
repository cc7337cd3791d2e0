"""Callbacks: early stopping, best checkpoints with top-k pruning over a resume, the model summary, and bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
from omegaconf import DictConfig

import runner
from _dist import clean_environ, run_cli
from conftest import TINY, compose_config, load_checkpoint, read_events, val_loss_of
from runner.callbacks import CallbackError
from runner.config import ConfigError
from runner.checks import validate

MakeCfg = Callable[..., DictConfig]
# The default experiment at its own size over-fits after about 3 epochs (val/loss rises from step 192 on).
DEFAULT_SIZE = tuple(o for o in TINY if not o.startswith(("data.", "model.", "trainer.max_", "trainer.log_every")))
EARLY = ("callbacks=[early_stopping,model_checkpoint]", "callbacks.early_stopping.patience=2",
         "trainer.max_epochs=30", "trainer.log_every_n_steps=32")


def all_scalars(run_dir: Path, tag: str) -> list:
    """A tag's events over every event file of the run folder (a resumed run adds one)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = []
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        accumulator.Reload()
        events += accumulator.Scalars(tag) if tag in accumulator.Tags()["scalars"] else []
    return events


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2], ids=["1-process", "2-processes"])
def test_early_stopping_stops_every_rank_at_one_step_and_keeps_the_best(tmp_path: Path, devices: int) -> None:
    ddp = ("strategy=ddp", "trainer.devices=2") if devices == 2 else ()
    cfg = compose_config([*DEFAULT_SIZE, *EARLY, *ddp, f"data.batch_size={64 // devices}"])
    metrics = runner.fit(cfg, run_dir=tmp_path)
    assert metrics["stopped_early"] is True and "stop_signal" not in metrics  # by a callback, not a signal
    assert metrics["step"] == metrics["early_stopping_step"] < 30 * 64
    assert "early_stopping: val/loss did not improve" in metrics["stopped_by"]
    val = [(e.step, e.value) for e in read_events(tmp_path).Scalars("val/loss")]
    best_step, best = min(val, key=lambda item: item[1])
    assert [step for step, _ in val][-3:] == [best_step, best_step + 64, best_step + 128]  # patience 2 after it
    assert (metrics["best_step"], metrics["best_model_score"]) == (best_step, pytest.approx(best, rel=1e-6))
    saved = load_checkpoint(tmp_path, "best.ckpt")
    assert saved["step"] == best_step
    assert val_loss_of(cfg, saved["model"]) == pytest.approx(best, rel=1e-5)
    assert load_checkpoint(tmp_path)["step"] == metrics["step"]  # last.ckpt at the stop
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert on_disk["best_model_path"] == str(tmp_path / "checkpoints" / "best.ckpt")
    for log in ["runner.log", *(["rank_1.log"] if devices == 2 else [])]:
        assert f"stopped at step {metrics['step']} by early_stopping" in (tmp_path / log).read_text(), log


@pytest.mark.parametrize("devices", [1, 2], ids=["1-process", "2-processes"])
def test_top_k_pruning_survives_a_resume_and_leaves_other_files(make_cfg: MakeCfg, tmp_path: Path,
                                                               devices: int) -> None:
    common = ("callbacks=model_checkpoint", "callbacks.model_checkpoint.save_top_k=2",
              "trainer.val_check_interval=1", "optimizer.lr=0.05", f"data.batch_size={16 // devices}",
              *(("strategy=ddp", "trainer.devices=2") if devices == 2 else ()))
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "best-step-999999.ckpt").write_text("another run's file")  # never ours to delete
    runner.fit(make_cfg(*common, "trainer.max_steps=5"), run_dir=tmp_path)
    runner.fit(make_cfg(*common, "trainer.max_steps=10", "trainer.ckpt_path=last"), run_dir=tmp_path)
    val = sorted((e.value, e.step) for e in all_scalars(tmp_path, "val/loss"))
    assert sorted(step for _, step in val) == list(range(1, 11))  # both runs' validations, each once
    expected = {f"best-step-{step:06d}.ckpt" for _, step in val[:2]}
    kept = {p.name for p in folder.glob("best-step-*.ckpt")} - {"best-step-999999.ckpt"}
    assert kept == expected
    assert (folder / "best-step-999999.ckpt").read_text() == "another run's file"
    assert load_checkpoint(tmp_path, "best.ckpt")["step"] == val[0][1]


@pytest.mark.parametrize("io", ["torch", "async"])
def test_keep_last_k_prunes_periodic_checkpoints(make_cfg: MakeCfg, tmp_path: Path, io: str) -> None:
    # async: the newest file is still being written when the old ones are pruned, and counts all the same
    runner.fit(make_cfg("trainer.max_steps=6", "trainer.ckpt_every_n_steps=1", "trainer.keep_last_k=2",
                        f"checkpoint_io={io}"), run_dir=tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*.ckpt")) == [
        "step-000005.ckpt", "step-000006.ckpt"]


def test_model_summary_counts_parameters_per_module(make_cfg: MakeCfg, tmp_path: Path) -> None:
    from tensorboard.plugins.hparams import plugin_data_pb2

    runner.fit(make_cfg("callbacks=model_summary"), run_dir=tmp_path)
    # TINY's MLP: 8 -> 16 -> 16 -> 4
    total = (8 * 16 + 16) + (16 * 16 + 16) + (16 * 4 + 4)
    assert f"model MLP: {total:,} parameters, {total:,} trainable" in (tmp_path / "runner.log").read_text()
    content = read_events(tmp_path).PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["model/params"].number_value == total


def test_monitor_and_mode_follow_the_objective(make_cfg: MakeCfg, tmp_path: Path) -> None:
    metrics = runner.fit(make_cfg("callbacks=model_checkpoint", "objective=val/acc", "direction=maximize",
                                  "trainer.val_check_interval=1"), run_dir=tmp_path)
    accuracy = [(e.value, e.step) for e in read_events(tmp_path).Scalars("val/acc")]
    best = max(accuracy, key=lambda item: (item[0], -item[1]))  # the first of equal bests
    assert (metrics["best_model_score"], metrics["best_step"]) == (pytest.approx(best[0]), best[1])


def test_a_monitor_nobody_logs_is_refused_at_the_first_validation(make_cfg: MakeCfg, tmp_path: Path) -> None:
    cfg = make_cfg("callbacks=early_stopping", "callbacks.early_stopping.monitor=val/f1",
                   "callbacks.early_stopping.mode=max", "trainer.max_steps=3")
    with pytest.raises(CallbackError, match=r"callbacks\.early_stopping\.monitor=val/f1 is not logged at "
                                            r"validation; the metrics are: .*val/acc, val/loss"):
        runner.fit(cfg, run_dir=tmp_path)


@pytest.mark.parametrize(("objective", "when"), [("val/acc2", "at validation"), ("train/los", "while training")])
def test_an_objective_nobody_logs_is_refused_where_it_would_first_appear(make_cfg: MakeCfg, tmp_path: Path,
                                                                         objective: str, when: str) -> None:
    """A misspelt objective once trained the whole run (every job of a sweep) for a value the sweeper never got. A
    refusal at a validation keeps what trained: last.ckpt is saved first, and the line says where."""
    cfg = make_cfg(f"objective={objective}", "trainer.max_steps=3", "trainer.log_every_n_steps=1")
    line = rf"objective={objective} is not logged {when}; the metrics are: .*train/loss"
    with pytest.raises(CallbackError, match=line) as refused:
        runner.fit(cfg, run_dir=tmp_path)
    assert not (tmp_path / "metrics.json").exists()
    last = tmp_path / "checkpoints" / "last.ckpt"
    if when == "at validation":
        assert str(refused.value).endswith(f"the training until step 3 is saved in {last}: fix the setting, then "
                                           f"resume with trainer.ckpt_path={last}")
        assert load_checkpoint(tmp_path)["step"] == 3
    for logged in ("val/acc", "train/acc", "lr"):
        assert runner.fit(make_cfg(f"objective={logged}", "trainer.max_steps=3"), run_dir=tmp_path / logged)["step"] == 3


@pytest.mark.parametrize(("overrides", "message"), [
    (("callbacks=model_checkpoint", "callbacks.model_checkpoint.save_top_k=-2"),
     r"callbacks\.model_checkpoint\.save_top_k=-2 is not allowed: use -1 \(keep all\)"),
    (("callbacks=early_stopping", "callbacks.early_stopping.patience=0"),
     r"callbacks\.early_stopping\.patience=0 must be a positive number"),
    (("callbacks=early_stopping", "callbacks.early_stopping.mode=up"),
     r"callbacks\.early_stopping\.mode=up must be one of min, max"),
    (("callbacks=early_stopping", "trainer.limit_val_batches=0"), None),
    (("+callbacks.odd._target_=runner.models.MLP",), r"callbacks\.odd \(MLP\) has none of the hooks"),
    (("trainer.keep_last_k=0",), r"trainer\.keep_last_k=0 must be a positive integer"),
    (("callbacks=early_stopping", "+callbacks.early_stopping.patiense=3"),
     r"callbacks\.early_stopping\.patiense is not a setting of callbacks\.early_stopping .*did you mean patience.*"
     r"allowed: min_delta, mode, monitor, patience"),
    (("callbacks=early_stopping", "callbacks.early_stopping.patience=many"), r"callbacks\.early_stopping\.patience=many"),
    # direction=minimize is about val/loss: a larger val/acc is better, so the mode must be said.
    (("callbacks=[early_stopping,model_checkpoint]", "callbacks.model_checkpoint.monitor=val/acc"),
     r"callbacks\.model_checkpoint\.monitor=val/acc is not the objective \(val/loss\), so direction=minimize says "
     r"nothing about it: set callbacks\.model_checkpoint\.mode=max \(larger is better\) or mode=min"),
])
def test_bad_callback_settings_are_refused_with_one_message(make_cfg: MakeCfg, tmp_path: Path, overrides: tuple,
                                                            message: str) -> None:
    if message is None:  # known only once the loop sees that nothing is validated, before the first step
        with pytest.raises(CallbackError, match=r"monitor=val/loss, but this run never validates"):
            runner.fit(make_cfg(*overrides), run_dir=tmp_path)
        assert not (tmp_path / "checkpoints").exists()
        return
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(*overrides))


@pytest.mark.parametrize("choice", ["early_stoping", "[model_checkpoint,early_stoping]"])
def test_an_unknown_callback_is_named_before_anything_runs(tmp_path: Path, choice: str) -> None:
    result = run_cli([f"callbacks={choice}", f"hydra.run.dir={tmp_path / 'run'}"], env=clean_environ(), cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: callbacks=early_stoping is not an option of callbacks: early_stopping, ema, grad_norm, "
        "model_checkpoint, model_summary, none (did you mean early_stopping?)"], result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
