"""A Lightning project as it is: a LightningDataModule reads its trainer, a LightningModule's steps, self.log,
configure_optimizers and hooks run as Lightning runs them, with the runner's exactness; what is not run is refused
before launch, one line each. Numbers are compared (1 process x 16 against 2 processes x 8), not exit codes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

import runner

from conftest import REPO, TINY, load_checkpoint, read_events

TESTS = Path(__file__).resolve().parent
DDP2 = ("strategy=ddp", "trainer.devices=2")
DATA_KEYS = "num_samples: 256\nval_samples: 64\nnum_features: 8\nnum_classes: 4\nseed: 0\n"


@pytest.fixture(autouse=True)
def _workers_import_the_fixtures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


def _cfg(tmp_path: Path, *overrides: str, data: str = "") -> DictConfig:
    """TINY with the fixtures' data module (`data=lit`) when `data` names its class."""
    conf = tmp_path / "conf" / "data"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "lit.yaml").write_text(f"_target_: lightning_modules.{data or 'GlobalBatchData'}\nglobal_batch_size: 16\n"
                                   + DATA_KEYS)
    base = [o for o in TINY if not (data and o.startswith("data."))]
    return runner.compose([*base, *(["data=lit"] if data else []), "model.in_features=8", "model.num_classes=4",
                           *overrides], config_dir=str(tmp_path / "conf"))


def _same_weights(first: Path, second: Path, atol: float = 1e-6) -> None:
    a, b = load_checkpoint(first), load_checkpoint(second)
    assert a["model"].keys() == b["model"].keys()
    for name, value in a["model"].items():
        torch.testing.assert_close(b["model"][name], value, rtol=0, atol=atol, msg=f"model.{name} differs")


# -- 1. data modules read the trainer view -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.xdist_group("lightning_ddp")
def test_a_datamodule_dividing_by_world_size_keeps_its_global_batch(tmp_path: Path) -> None:
    """GlobalBatchData.setup() divides its global batch by self.trainer.world_size: 1 process x 16 and 2 x 8 train
    the same global batches, to the same weights (it read None before, and its global batch doubled under DDP)."""
    one = runner.fit(_cfg(tmp_path, data="GlobalBatchData"), run_dir=tmp_path / "one")
    two = runner.fit(_cfg(tmp_path, *DDP2, data="GlobalBatchData"), run_dir=tmp_path / "two")
    assert one["step"] == two["step"] == 3
    assert load_checkpoint(tmp_path / "one")["global_batch_size"] == 16
    assert load_checkpoint(tmp_path / "two")["global_batch_size"] == 16
    _same_weights(tmp_path / "one", tmp_path / "two")


def test_the_trainer_view_answers_what_it_lists_and_names_what_it_lacks(tmp_path: Path) -> None:
    from runner.lightning.trainer_view import TrainerView
    from runner.strategies import SingleDeviceStrategy

    view = TrainerView(_cfg(tmp_path), SingleDeviceStrategy(device=torch.device("cpu")), tmp_path)
    assert (view.world_size, view.global_rank, view.local_rank, view.node_rank, view.num_nodes) == (1, 0, 0, 0, 1)
    assert (view.num_devices, view.is_global_zero, view.current_epoch, view.global_step) == (1, True, 0, 0)
    assert (view.max_steps, view.accumulate_grad_batches, view.precision) == (3, 1, "32-true")
    assert (view.training, view.validating, view.sanity_checking, view.log_dir) == (True, False, False, str(tmp_path))
    view.should_stop = True
    assert view.should_stop is True
    with pytest.raises(AttributeError, match=r"trainer.fit_loop: the runner's trainer view has no attribute "
                                             r"'fit_loop'; it has world_size, global_rank, .*should_stop"):
        view.fit_loop
    assert not hasattr(view, "fit_loop")
    with pytest.raises(AttributeError, match="trainer.world_size cannot be set"):
        view.world_size = 4


def test_nothing_outside_runner_lightning_imports_lightning() -> None:
    """Lightning stays the user's dependency: only runner/lightning speaks it, and it never imports it either."""
    importers = []
    for path in (REPO / "runner").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric") for n in names):
                importers.append(str(path.relative_to(REPO)))
    assert importers == []


# -- 2. a LightningModule runs as Lightning runs it ------------------------------------------------------------------
LIT = ("model._target_=lightning_modules.LitClassifier", "+model.lr=0.2", "trainer.max_steps=64",
       "trainer.log_every_n_steps=8")


def _by_hand(weights: dict) -> tuple[float, float]:
    """(val loss, val accuracy) of `weights` on TINY's synthetic validation set, computed here."""
    from lightning_modules import LitClassifier
    from runner.data import SyntheticClassification

    model = LitClassifier(in_features=8, hidden=16, depth=2, num_classes=4)
    model.load_state_dict(weights)
    val = SyntheticClassification(num_samples=256, val_samples=64, num_features=8, num_classes=4, seed=0).val_dataset
    with torch.no_grad():
        logits = model(val.inputs)
    loss = torch.nn.functional.cross_entropy(logits, val.targets).item()
    return loss, (logits.argmax(dim=1) == val.targets).float().mean().item()


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.slow
@pytest.mark.xdist_group("lightning_ddp")
def test_a_lightning_module_trains_as_lightning_on_one_and_two_processes(tmp_path: Path) -> None:
    """LitClassifier (MNISTLitModule's shape) with a Lightning callback: 1 process x 16 and 2 processes x 8 end with
    the same weights; val/loss and val/acc (torchmetrics objects, synced at the epoch's end) equal the final weights'
    loss and accuracy computed by hand; ReduceLROnPlateau stepped on val/loss at each epoch's end; the hooks ran in
    Lightning's order with the view's step and epoch."""
    results = {}
    for name, overrides in (("one", ()), ("two", (*DDP2, "data.batch_size=8"))):
        folder = tmp_path / f"record-{name}"
        folder.mkdir()
        cfg = _cfg(tmp_path, *LIT, *overrides, f"+model.record={folder}",
                   "+callbacks.rec._target_=lightning_modules.RecordingCallback", f"+callbacks.rec.folder={folder}")
        results[name] = runner.fit(cfg, run_dir=tmp_path / name)
    one, two = results["one"], results["two"]
    _same_weights(tmp_path / "one", tmp_path / "two", atol=1e-5)
    final = load_checkpoint(tmp_path / "one")
    loss, accuracy = _by_hand(final["model"])
    for metrics in (one, two):
        assert metrics["step"] == 64 and metrics["epoch"] == 4
        assert metrics["val/loss"] == pytest.approx(loss, abs=1e-5)
        assert metrics["val/acc"] == pytest.approx(accuracy, abs=1e-6)
        assert metrics["val/acc_best"] >= metrics["val/acc"]
        assert {"train/loss", "train/acc", "lr"} <= set(metrics) and "val/val/loss" not in metrics
    # The schedule: val/loss rose after epochs 2 and 3 (steps 48, 64), so the plateau halved the rate there (the
    # last train log, at step 64 before its validation, shows 0.1), on both.
    assert [one["lr"], two["lr"]] == [0.1, 0.1]
    assert final["scheduler"]["epochs"] == 4 and final["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.05)
    hooks = _lines(tmp_path / "record-two" / "hooks")
    rank0 = [line.rsplit(" ", 3)[0] + " " + " ".join(line.split()[2:]) for line in hooks if line.split()[1] == "0"]
    assert rank0 == ["setup:fit 0 0", "on_train_start 0 0", *[f"{hook} {step} {epoch}" for epoch in range(4)
                     for hook, step in (("on_train_epoch_start", 16 * epoch), ("on_train_epoch_end", 16 * epoch + 16))],
                     "on_fit_end 64 4"]
    assert sorted(line.split()[1] for line in hooks) == ["0"] * 11 + ["1"] * 11
    # The Lightning callback: (trainer, pl_module) on every process, with the metrics the run logged.
    calls = _lines(tmp_path / "record-two" / "callback")
    assert sorted(c for c in calls if c.startswith("on_fit_start")) == ["on_fit_start 0/2 LitClassifier",
                                                                         "on_fit_start 1/2 LitClassifier"]
    assert f"on_validation_end 1 64 {two['val/loss']:.6f}" in calls
    assert [c for c in calls if c.startswith("on_train_epoch_end 0")] == [f"on_train_epoch_end 0 {e}" for e in range(4)]
    assert load_checkpoint(tmp_path / "two")["callbacks"]["lightning"]["callbacks"]["rec"]["state"] == {
        "validations": 4}


def test_a_lightning_module_resumes_exactly(tmp_path: Path) -> None:
    """40 steps, or 24 then 16 more from last.ckpt (mid-epoch, the plateau's state and the epoch count carried): the
    same weights, learning rate and scheduler state."""
    runner.fit(_cfg(tmp_path, *LIT, "trainer.max_steps=40"), run_dir=tmp_path / "straight")
    runner.fit(_cfg(tmp_path, *LIT, "trainer.max_steps=24"), run_dir=tmp_path / "first")
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    resumed = runner.fit(_cfg(tmp_path, *LIT, "trainer.max_steps=40", f"trainer.ckpt_path={last}"),
                         run_dir=tmp_path / "resumed")
    assert resumed["step"] == 40
    _same_weights(tmp_path / "straight", tmp_path / "resumed", atol=0)
    straight, again = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "resumed")
    assert straight["scheduler"] == again["scheduler"]
    assert straight["optimizer"]["param_groups"][0]["lr"] == again["optimizer"]["param_groups"][0]["lr"]


@pytest.mark.slow
@pytest.mark.xdist_group("lightning_ddp")
def test_plain_logging_and_skipped_batches_on_one_and_two_processes(tmp_path: Path) -> None:
    """A loss tensor, self.log of tensors and numbers (names without a prefix are the stage's), every third batch
    skipped (None): 1 process x 16 and 2 x 8 take the same SGD steps (the skipped ones change nothing, and DDP's
    processes stay in step); the step reads self.trainer.world_size. The module logs an image through
    self.logger.experiment on every process: rank 1's logger stands in for rank 0's (the same log_dir, an
    experiment that does nothing), so the run's one event file holds rank 0's image alone."""
    plain = ("model._target_=lightning_modules.LitMedia", "+model.skip_every=3", "trainer.max_steps=6")
    one = runner.fit(_cfg(tmp_path, *plain), run_dir=tmp_path / "one")
    two = runner.fit(_cfg(tmp_path, *plain, *DDP2, "data.batch_size=8"), run_dir=tmp_path / "two")
    _same_weights(tmp_path / "one", tmp_path / "two")
    assert (one["train/world"], two["train/world"]) == (1.0, 2.0)
    # Step 6 skipped its batch: the window has no loss (the last one stays) but what was logged before the skip.
    assert one["train/loss"] == pytest.approx(two["train/loss"], abs=1e-6)
    assert one["train/loss_seen"] == pytest.approx(two["train/loss_seen"], abs=1e-6)
    assert {"val/loss", "val/acc"} <= set(one) and "val/val/loss" not in one
    assert [event.step for event in read_events(tmp_path / "two").Images("val/sample")] == [6]  # one event file
    assert {path.name for path in (tmp_path / "two" / "tensorboard").glob("seen-*")} == {"seen-0", "seen-1"}
    assert two["val/seen_loggers"] == 1.0


@pytest.mark.parametrize(("overrides", "line"), [
    (("model._target_=lightning_modules.StepsItself",),
     r"model \(StepsItself\) overrides optimizer_step, which the runner does not call: the runner's step calls "),
    (("model._target_=lightning_modules.TwoOptimizersAutomatic",),
     r"TwoOptimizersAutomatic.configure_optimizers\(\) returned 2 optimizers with automatic optimization: set "
     r"self.automatic_optimization = False"),
    (("model._target_=lightning_modules.ManualTwoOptimizers", "trainer.accumulate_grad_batches=2"),
     r"trainer.accumulate_grad_batches=2: model \(ManualTwoOptimizers\) uses manual optimization; accumulate in"),
    (("model._target_=lightning_modules.ManualTwoOptimizers", "trainer.gradient_clip_val=1.0"),
     r"trainer.gradient_clip_val=1.0: .* call self.clip_gradients\(opt"),
    (("model._target_=lightning_modules.LitPlain", "+callbacks.s._target_=lightning_modules.SanityCallback"),
     r"callbacks.s \(SanityCallback\) overrides on_sanity_check_start, which the runner does not call"),
    (("+callbacks.r._target_=lightning_modules.RecordingCallback", "+callbacks.r.folder=.",
      "+callbacks.s._target_=lightning_modules.SanityCallback"),
     r"callbacks.s \(SanityCallback\) overrides on_sanity_check_start"),
    (("model._target_=lightning_modules.LitPlain", "+callbacks.swa._target_=lightning.pytorch.callbacks"
      ".StochasticWeightAveraging", "+callbacks.swa.swa_lrs=0.01"),
     r"callbacks.swa: lightning.pytorch.callbacks.stochastic_weight_avg.StochasticWeightAveraging is Lightning's own "
     r"StochasticWeightAveraging, which reaches into Lightning's Trainer; .* the runner's is callbacks=ema"),
    (("model._target_=lightning_modules.LitPlain", "strategy=dp"),
     r"strategy=dp: a LightningModule runs under strategy=ddp"),
    (("model._target_=lightning_modules.LitPlain", "+metrics.acc._target_=runner.metrics.Accuracy"),
     r"metrics=\['acc'\]: a LightningModule logs its own metrics"),
], ids=["optimizer_step", "two-optimizers-automatic", "manual-accumulate", "manual-clip", "callback-hook", "plain-model-callback", "stock-callback", "dp",
        "metrics-config"])
def test_what_is_not_run_is_refused_before_launch_in_one_line(tmp_path: Path, overrides: tuple, line: str) -> None:
    from runner.checks import validate
    from runner.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        validate(_cfg(tmp_path, *overrides))
    assert len([p for p in refused.value.problems if __import__("re").search(line, p)]) == 1, refused.value.problems


def test_a_lightning_project_passes_the_checks(tmp_path: Path) -> None:
    from runner.checks import validate

    validate(_cfg(tmp_path, *LIT, "+callbacks.rec._target_=lightning_modules.RecordingCallback",
                  f"+callbacks.rec.folder={tmp_path}"))


def test_a_step_scheduler_over_estimated_stepping_batches_and_should_stop(tmp_path: Path) -> None:
    """OneCycleLR over self.trainer.estimated_stepping_batches (10), stepped each optimizer step; should_stop set at
    step 4 ends the run there: the rate is OneCycleLR's after 4 steps of 10."""
    cycle = ("model._target_=lightning_modules.LitOneCycle", "+model.stop_at=4", "trainer.max_steps=10")
    metrics = runner.fit(_cfg(tmp_path, *cycle), run_dir=tmp_path / "run")
    assert metrics["step"] == 4 and metrics["stopped_early"] is True
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(reference, max_lr=0.1, total_steps=10)
    for _ in range(4):
        reference.step()
        schedule.step()
    saved = load_checkpoint(tmp_path / "run")
    assert saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(reference.param_groups[0]["lr"], rel=1e-12)
    assert saved["scheduler"]["steps"] == 4


# -- 3. manual optimization: several optimizers stepped by the module --------------------------------------------------
MANUAL = ("model._target_=lightning_modules.ManualTwoOptimizers", "+model.clip=0.5", "trainer.max_steps=8")


@pytest.mark.slow
@pytest.mark.xdist_group("lightning_ddp")
def test_manual_optimization_with_two_optimizers_on_one_and_two_processes(tmp_path: Path) -> None:
    """A GAN's alternating steps (two optimizers, two backward passes through one forward graph, clip_gradients,
    toggle_model, schedulers the module steps): 1 process x 16, 2 DDP processes x 8 (DDP's own gradient hooks would
    fail on the second backward pass) and 2 FSDP processes x 8 (each backward pass reduce-scatters its units'
    gradients, which add up over the step's passes; clip_gradients on the shards) take the same steps; both
    optimizers and schedulers are in the checkpoint."""
    one = runner.fit(_cfg(tmp_path, *MANUAL), run_dir=tmp_path / "one")
    two = runner.fit(_cfg(tmp_path, *MANUAL, *DDP2, "data.batch_size=8"), run_dir=tmp_path / "two")
    _same_weights(tmp_path / "one", tmp_path / "two")
    assert one["train/body_loss"] == pytest.approx(two["train/body_loss"], abs=1e-6)
    fsdp = runner.fit(_cfg(tmp_path, *MANUAL, "strategy=fsdp", "trainer.devices=2", "data.batch_size=8",
                           "strategy.state_dict_type=full"), run_dir=tmp_path / "fsdp")
    _same_weights(tmp_path / "one", tmp_path / "fsdp", atol=1e-5)
    assert fsdp["train/body_loss"] == pytest.approx(one["train/body_loss"], abs=1e-5)
    assert fsdp["train/head_loss"] == pytest.approx(one["train/head_loss"], abs=1e-5)
    saved = load_checkpoint(tmp_path / "one")
    assert saved["optimizer"]["classes"] == ["SGD", "Adam"]
    head, body = saved["optimizer"]["optimizers"]
    assert head["param_groups"][0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)  # StepLR(2): halved at steps 2, 4, 6, 8
    assert body["param_groups"][0]["lr"] == pytest.approx(0.01 * 0.5 ** 2)  # StepLR(3): at steps 3 and 6
    assert head["state"] and body["state"]  # momentum and Adam's moments


def test_manual_optimization_resumes_exactly(tmp_path: Path) -> None:
    """8 steps, or 5 then 3 more from last.ckpt: the same weights, both optimizers' states and both schedules."""
    runner.fit(_cfg(tmp_path, *MANUAL), run_dir=tmp_path / "straight")
    runner.fit(_cfg(tmp_path, *MANUAL, "trainer.max_steps=5"), run_dir=tmp_path / "first")
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    runner.fit(_cfg(tmp_path, *MANUAL, f"trainer.ckpt_path={last}"), run_dir=tmp_path / "resumed")
    _same_weights(tmp_path / "straight", tmp_path / "resumed", atol=0)
    straight, again = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "resumed")
    assert straight["scheduler"] == again["scheduler"]
    for a, b in zip(straight["optimizer"]["optimizers"], again["optimizer"]["optimizers"]):
        assert a["param_groups"] == b["param_groups"]
        for key, state in a["state"].items():
            for name, value in state.items():
                torch.testing.assert_close(b["state"][key][name], value, rtol=0, atol=0)


def test_predict_step_gives_the_predictions(tmp_path: Path) -> None:
    """stage=predict calls the module's predict_step (its own output, softmax here, not forward's logits) for every
    sample once, in the data set's order, with on_predict_batch_start before each batch."""
    lit = ("model._target_=lightning_modules.LitPredicts", "trainer.max_steps=2")
    runner.fit(_cfg(tmp_path, *lit), run_dir=tmp_path / "fit")
    ckpt = tmp_path / "fit" / "checkpoints" / "last.ckpt"
    cfg = _cfg(tmp_path, *lit, "stage=predict", f"trainer.ckpt_path={ckpt}", "data.test_samples=40")
    runner.fit(cfg, run_dir=tmp_path / "predict")
    predictions = torch.load(tmp_path / "predict" / "predictions.pt", weights_only=True)["predictions"]
    data = runner.build.build_data(cfg, None)
    samples = [data.predict_dataset[i] for i in range(len(data.predict_dataset))]
    inputs = torch.stack([s[0] if isinstance(s, (tuple, list)) else s for s in samples])
    assert inputs.shape == (40, 8)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    net.load_state_dict({k.removeprefix("net."): v for k, v in load_checkpoint(tmp_path / "fit")["model"].items()})
    torch.testing.assert_close(predictions, torch.softmax(net(inputs), dim=-1).detach(), atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.xdist_group("lightning_ddp")
def test_uneven_validation_shares_under_fsdp_count_each_sample_once(tmp_path: Path) -> None:
    """65 validation samples on 2 FSDP processes x 8: 5 batches and 4, so one process runs a padding forward (FSDP's
    all-gathers must match); the module's Accuracy object and self.log do not see it: val/acc is 1 process's over the
    same 65 samples (its val/loss, a MeanMetric of batch means, depends on the batching)."""
    lit = ("model._target_=lightning_modules.LitClassifier", "trainer.max_steps=4", "data.val_samples=65")
    one = runner.fit(_cfg(tmp_path, *lit), run_dir=tmp_path / "one")
    two = runner.fit(_cfg(tmp_path, *lit, "strategy=fsdp", "trainer.devices=2", "data.batch_size=8"),
                     run_dir=tmp_path / "two")
    assert two["val/acc"] == pytest.approx(one["val/acc"], abs=1e-6)


@pytest.mark.parametrize(("overrides", "line"), [
    (("model._target_=lightning_modules.LitPlain", "+callbacks.boom._target_=lightning_modules.RaisingCallback"),
     "callbacks.boom.on_train_epoch_start() raised RuntimeError: injected failure in a Lightning callback"),
    (("model._target_=lightning_modules.RaisesOnTrainStart",),
     "model (RaisesOnTrainStart).on_train_start() raised RuntimeError: injected failure in a module hook"),
], ids=["callback", "module"])
def test_a_lightning_hook_that_raises_is_one_line_naming_it(tmp_path: Path, overrides: tuple, line: str) -> None:
    from runner.errors import HookFailed

    with pytest.raises(HookFailed) as failed:
        runner.fit(_cfg(tmp_path, *overrides), run_dir=tmp_path / "run")
    assert str(failed.value) == line


# -- 4. settings the user did not choose ---------------------------------------------------------------------------
OWN = ("model._target_=lightning_modules.LitOwnNames", "trainer.max_steps=4", "trainer.val_check_interval=2")


def test_the_default_objective_never_fails_a_module_that_logs_other_names(tmp_path: Path) -> None:
    """val/lit_loss, not val/loss: the run trains to its end and keeps its checkpoints, without an objective (one
    line says so); with a ReduceLROnPlateau watching val/lit_acc, that monitor (mode max) is the objective."""
    plain = runner.fit(_cfg(tmp_path, *OWN), run_dir=tmp_path / "plain")
    assert plain["step"] == 4 and "best" not in plain
    assert (tmp_path / "plain" / "checkpoints" / "last.ckpt").exists()
    assert ("objective=val/loss (the default, not set) is not logged at validation: this run has no objective"
            in (tmp_path / "plain" / "runner.log").read_text())
    watched = runner.fit(_cfg(tmp_path, *OWN, "+model.plateau=true"), run_dir=tmp_path / "watched")
    accuracies = [event.value for event in read_events(tmp_path / "watched").Scalars("val/lit_acc")]
    assert len(accuracies) == 2
    assert watched["best"]["metric"] == "val/lit_acc" and watched["best"]["value"] == pytest.approx(max(accuracies))
    assert "this run's objective is val/lit_acc (maximize), its lr_scheduler monitor (ReduceLROnPlateau" in (
        tmp_path / "watched" / "runner.log").read_text()



def test_stage_check_refuses_an_objective_the_modules_validation_does_not_log(tmp_path: Path) -> None:
    """objective=val/foo with a module that logs val/lit_loss and val/lit_acc: the run would train to its first
    validation and stop there; stage=check says so in one line naming what is logged. A logged objective, or none
    set, passes; a user's callback (which may log it) leaves it to the run."""
    from runner.config import ConfigError
    from runner.job import check

    with pytest.raises(ConfigError) as refused:
        check(_cfg(tmp_path, *OWN, "objective=val/foo"))
    assert refused.value.problems == [
        "objective=val/foo is not logged at validation by model (lightning_modules.LitOwnNames): its validation logs "
        "val/lit_acc, val/lit_loss; set objective to one of them, or leave it unset (the run then ranks by the "
        "module's own monitor, if any)"]
    check(_cfg(tmp_path, *OWN, "objective=val/lit_acc", "direction=maximize"))
    check(_cfg(tmp_path, *OWN))
    check(_cfg(tmp_path, *OWN, "objective=val/foo", "+callbacks.rec._target_=lightning_modules.RecordingCallback",
               f"+callbacks.rec.folder={tmp_path}"))


def test_a_run_whose_every_batch_is_skipped_ends_in_one_line(tmp_path: Path) -> None:
    """training_step returns None on every batch: the 5 steps count as Lightning's global_step counts them, but the
    result says no optimizer step was taken, and the run ends in one line saying it trained nothing (not `done`)."""
    cfg = _cfg(tmp_path, "model._target_=lightning_modules.LitPlain", "+model.skip_every=1", "trainer.max_steps=5")
    result = runner.fit(cfg, run_dir=tmp_path / "run")
    assert (result["step"], result["skipped_steps"], result["trained"]) == (5, 5, False)
    assert "train/loss" not in result
    ends = [line for line in _lines(tmp_path / "run" / "runner.log") if " - done" in line]
    assert len(ends) == 1 and "done, and nothing trained: every batch of this run's 5 steps was skipped" in ends[0]


def test_fine_tuning_from_weights_loads_non_strictly_and_names_what_runs(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """LitCalibrated adds a buffer to what LitPlain's checkpoint holds: trainer.resume=weights is refused before
    launch, in one line naming the way out; with trainer.strict_loading=false (Lightning's strict=False) its weights
    load, and one line lists the key the checkpoint lacks. The lines and the HParams name what runs: the module's
    SGD and OneCycleLR, not the config's optimizer group and ConstantLR."""
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    from runner.config import ConfigError

    runner.fit(_cfg(tmp_path, "model._target_=lightning_modules.LitPlain", "trainer.max_steps=2"),
               run_dir=tmp_path / "plain")
    ckpt = tmp_path / "plain" / "checkpoints" / "last.ckpt"
    tune = ("model._target_=lightning_modules.LitCalibrated", "trainer.resume=weights", f"trainer.ckpt_path={ckpt}")
    with pytest.raises(ConfigError, match=r"holds another model than model=lightning_modules.LitCalibrated: missing "
                                          r"calibration \(trainer.strict_loading=false loads it without"):
        runner.fit(_cfg(tmp_path, *tune), run_dir=tmp_path / "strict")
    assert runner.fit(_cfg(tmp_path, *tune, "trainer.strict_loading=false"), run_dir=tmp_path / "tuned")["step"] == 3
    log = (tmp_path / "tuned" / "runner.log").read_text()
    assert "loaded without 1 key(s) of the model, kept as built (calibration), and 0 of the checkpoint" in log
    assert re.search(r"a new optimizer and schedule from step 0: SGD \(lr [0-9.e-]+\), OneCycleLR \(interval step\) "
                     r"from configure_optimizers\(\)", log)
    content = read_events(tmp_path / "tuned").PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["configure_optimizers.optimizer"].string_value == "SGD"
    assert hparams["configure_optimizers.scheduler"].string_value == "OneCycleLR"
    assert not [key for key in hparams if key.split(".")[0] in ("optimizer", "scheduler", "task")]
    assert not [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]


def test_a_resume_past_the_end_of_its_one_cycle_is_refused_before_launch(tmp_path: Path) -> None:
    """OneCycleLR over estimated_stepping_batches (4): resumed to step 6, it crashed at step 5 after everything had
    loaded. It is refused before launch in one line naming trainer.resume=new_schedule, which makes the module's
    schedule afresh (configure_optimizers() with the 2 steps left) for the run's own optimizer."""
    from runner.config import ConfigError

    cycle = ("model._target_=lightning_modules.LitOneCycle", "trainer.max_steps=4")
    runner.fit(_cfg(tmp_path, *cycle), run_dir=tmp_path / "first")
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    more = (*cycle, "trainer.max_steps=6", f"trainer.ckpt_path={last}")
    with pytest.raises(ConfigError, match=r"its OneCycleLR was planned over 4 steps and has 0 left at step 4, but "
                                          r"this run goes on to step 6, and it would fail at step 5; set "
                                          r"trainer.resume=new_schedule to make the schedule afresh"):
        runner.fit(_cfg(tmp_path, *more), run_dir=tmp_path / "refused")
    assert not (tmp_path / "refused" / "checkpoints").exists()
    assert runner.fit(_cfg(tmp_path, *more, "trainer.resume=new_schedule"), run_dir=tmp_path / "more")["step"] == 6
    saved = load_checkpoint(tmp_path / "more")
    assert saved["scheduler"]["schedulers"][0]["total_steps"] == 2 and saved["scheduler"]["steps"] == 2
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(reference, max_lr=0.1, total_steps=2)
    for _ in range(2):
        reference.step()
        schedule.step()
    assert saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(reference.param_groups[0]["lr"], rel=1e-12)


# -- 5. Lightning's logger surface, and media from anywhere ---------------------------------------------------------
def test_self_logger_has_lightnings_surface_and_media_reach_every_logger(tmp_path: Path) -> None:
    """self.logger.experiment is TensorBoard's SummaryWriter writing into the run's one event file (an image and a
    histogram at the module's global_step); self.logger.log_metrics logs what it is given, reduced by nothing;
    log_hyperparams adds the module's own to the HParams (and to csv's hparams.yaml); self.loggers lists both loggers
    and log_dir is the event folder. A runner callback logs a histogram and a text through runner.loggers."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    cfg = _cfg(tmp_path, "model._target_=lightning_modules.LitMedia", "trainer.max_steps=4",
               "trainer.val_check_interval=2", "logger=[tensorboard,csv]", "+callbacks.media._target_=hook_fixtures.Media")
    result = runner.fit(cfg, run_dir=tmp_path / "run")
    assert result["val/seen_loggers"] == 2
    events = EventAccumulator(str(next((tmp_path / "run" / "tensorboard").glob("events.*"))), size_guidance={
        "images": 0, "histograms": 0, "scalars": 0, "tensors": 0})
    events.Reload()
    assert [event.step for event in events.Images("val/sample")] == [2, 4]
    assert [event.step for event in events.Histograms("weights/first")] == [2, 4]
    assert [(event.step, event.value) for event in events.Scalars("custom/metric")] == [(2, 3.5), (4, 5.5)]
    assert [event.step for event in events.Histograms("callback/weights")] == [2, 4]
    assert [event.step for event in events.Tensors("callback/note/text_summary")] == [2, 4]
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["user.depth"].number_value == 2 and hparams["user.note"].string_value == "mine"
    assert (tmp_path / "run" / "tensorboard" / "seen-0").read_text() == "4"
    assert "user.depth: 2" in (tmp_path / "run" / "hparams.yaml").read_text()  # self.loggers: both loggers
