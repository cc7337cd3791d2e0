"""Every value a user types is checked or caught: exit 1, one line naming the key, no traceback, and nothing
written but Hydra's own run folder (.hydra/ and runner.log). The matrix runs `runner.cli.main` in-process
(a second each); a handful of cases go through `python -m runner` in a subprocess as well."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

import runner
from conftest import TINY, clean_environ, run_main
from runner import cli
from runner.config import ConfigError

# The tiny CPU run, without TINY's TensorBoard setting (several cases choose other loggers).
BASE = [o for o in TINY if not o.startswith("logger.")]

# (id, overrides, text one line of stderr must hold). {tmp} is this module's scratch folder.
BAD_INPUT = [
    # -- the cases
    ("seed-overflow", ["trainer.seed=99999999999999999999"], "trainer.seed=99999999999999999999 must be an integer"),
    ("negative-num-workers", ["data.num_workers=-1"], "data.num_workers=-1 must be 0"),
    ("step-size-zero", ["scheduler=step", "scheduler.step_size=0"], "scheduler.step_size=0"),
    ("find-unused-maybe", ["strategy=ddp", "strategy.find_unused_parameters=maybe"],
     "strategy.find_unused_parameters=maybe is not true or false"),
    ("no-logger", ["~logger"], "logger is not set"),
    ("logger-null", ["logger=null"], "logger=null is not an option of logger: csv, mlflow, none, tensorboard, wandb "
                                     "(logger=none logs nothing; ~logger removes the group)"),
    ("no-scheduler", ["~scheduler"], "scheduler is not set"),
    ("misspelled-trainer-key-added", ["+trainer.devicez=2"], "trainer.devicez is not a trainer setting (did you mean"),
    ("top-level-seed", ["+seed=42"], "seed is not a top-level key (did you mean trainer.seed?)"),
    ("precision-under-trainer", ["+trainer.precision=bf16-mixed"], "precision is a config group: precision=<option>"),
    ("strategy-under-trainer", ["+trainer.strategy=ddp"], "strategy is a config group: strategy=<option>"),
    ("misspelled-ddp-timeout", ["strategy=ddp", "+strategy.timeot=5"],
     "strategy.timeot is not a setting of strategy (runner.strategies.DDPStrategy) (did you mean timeout?)"),
    ("unknown-ddp-argument", ["strategy=ddp", "+strategy.foo=1"], "strategy.foo is not a setting of strategy"),
    ("model-narrower-than-data", ["model.in_features=16"], "model.in_features=16"),
    ("another-optimizers-checkpoint", ["trainer.ckpt_path={tmp}/sgd.ckpt"], "holds the state of another optimizer"),
    # -- options a group does not have: the group's own, one line (Hydra's were 8 to 13)
    ("optimizer-lion", ["optimizer=lion"], "optimizer=lion is not an option of optimizer: adamw, parts, sgd"),
    ("accelerator-tpu", ["accelerator=tpu"],
     "accelerator=tpu is not an option of accelerator: auto, cpu, cuda (did you mean cpu?)"),
    ("cluster-k8s", ["cluster=k8s"], "cluster=k8s is not an option of cluster: auto, local, slurm, torchelastic"),
    ("checkpoint-io-s3", ["checkpoint_io=s3"], "checkpoint_io=s3 is not an option of checkpoint_io: async, torch"),
    ("precision-fp32", ["precision=fp32"],
     "precision=fp32 is not an option of precision: 16-mixed, 16-true, 32-true, 64-true, bf16-mixed, bf16-true"),
    ("scheduler-onecycle", ["scheduler=onecycle"], "scheduler=onecycle is not an option of scheduler: constant,"),
    ("task-segmentation", ["task=segmentation"],
     "task=segmentation is not an option of task: classification, language_model, model, regression"),
    ("launcher-bogus", ["hydra/launcher=bogus"], "hydra/launcher=bogus is not an option of hydra/launcher: basic,"),
    ("model-resnet", ["model=resnet"], "model=resnet is not an option of model: mlp"),
    ("callbacks-bogus", ["callbacks=[early_stopping,bogus]"],
     "callbacks=bogus is not an option of callbacks: early_stopping, ema, grad_norm, model_checkpoint,"),
    # -- trainer
    ("misspelled-trainer-key", ["trainer.devicez=2"], "trainer.devicez"),
    ("devices-not-a-number", ["trainer.devices=abc"], "trainer.devices=abc is not allowed"),
    ("devices-quoted", ["trainer.devices='2'"],
     "trainer.devices='2' is a string, not a number (quoted on the command line or in YAML): write trainer.devices=2"),
    ("zero-devices", ["trainer.devices=0"], "trainer.devices=0 is not allowed"),
    ("negative-device-index", ["trainer.devices=[0,-1]"], "trainer.devices=[0, -1] is not allowed"),
    ("zero-max-steps", ["trainer.max_steps=0"], "trainer.max_steps=0 must be a positive integer"),
    ("max-steps-not-a-number", ["trainer.max_steps=abc"], "trainer.max_steps=abc"),
    ("fractional-seed", ["trainer.seed=1.5"], "trainer.seed=1.5"),
    ("zero-log-every", ["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps=0 must be a positive integer"),
    ("zero-accumulate", ["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0 must be"),
    ("negative-clip", ["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val=-1.0 must be a positive number"),
    ("nan-clip", ["trainer.gradient_clip_val=nan"], "trainer.gradient_clip_val=nan must be a positive number"),
    ("tensorboard-folder-is-a-file", ["logger.tensorboard.subdir={tmp}/taken/tensorboard"],
     "cannot write in {tmp}/taken/tensorboard: {tmp}/taken/tensorboard is a file"),
    ("limit-above-one", ["trainer.limit_train_batches=1.5"], "trainer.limit_train_batches=1.5 is not allowed"),
    ("zero-val-interval", ["trainer.val_check_interval=0.0"], "trainer.val_check_interval=0.0 is not allowed"),
    ("negative-fast-dev-run", ["trainer.fast_dev_run=-1"], "trainer.fast_dev_run=-1 must be true, false"),
    ("progress-bar-one", ["trainer.progress_bar=1"], "trainer.progress_bar=1 is not allowed: use auto"),
    ("progress-bar-maybe", ["trainer.progress_bar=maybe"], "trainer.progress_bar=maybe is not allowed: use auto"),
    ("compile-not-a-setting", ["trainer.compile=fast"], "trainer.compile=fast must be true, false"),
    ("negative-restarts", ["trainer.max_restarts=-1"], "trainer.max_restarts=-1 must be 0"),
    ("zero-ckpt-every", ["trainer.ckpt_every_n_steps=0"], "trainer.ckpt_every_n_steps=0 must be a positive"),
    ("forever", ["trainer.max_steps=-1", "trainer.max_epochs=-1"], "would train forever"),
    ("two-nodes-locally", ["trainer.num_nodes=2"], "trainer.num_nodes=2"),
    ("missing-checkpoint", ["trainer.ckpt_path=/missing.ckpt"], "trainer.ckpt_path=/missing.ckpt: checkpoint not"),
    ("corrupt-checkpoint", ["trainer.ckpt_path={tmp}/corrupt.ckpt"], "trainer.ckpt_path={tmp}/corrupt.ckpt"),
    # -- runner-owned groups
    ("unknown-strategy", ["strategy=nonexistent"],
     "strategy=nonexistent is not an option of strategy: auto, ddp, dp, fsdp, single"),
    ("numeric-precision", ["precision=17"], "precision=17 is not an option of precision: 16-mixed, 16-true,"),
    ("cuda-without-gpu", ["accelerator=cuda"], "accelerator=cuda but no CUDA device is available"),
    ("fp16-mixed-on-cpu", ["precision=16-mixed"], "precision=16-mixed needs accelerator=cuda"),
    ("mixed-precision-value", ["precision=bf16-mixed", "precision.precision=32"],
     "precision.precision=32 must be one of 16-mixed, bf16-mixed"),
    ("start-method", ["strategy=ddp", "strategy.start_method=thread"], "strategy.start_method=thread must be one of"),
    ("zero-timeout", ["strategy=ddp", "strategy.timeout=0"], "strategy.timeout=0.0 must be a positive number"),
    ("timeout-not-a-number", ["strategy=ddp", "strategy.timeout=soon"], "strategy.timeout=soon is not a number"),
    ("single-strategy-key", ["+strategy.timeout=5"], "strategy.timeout is not a setting of strategy "
                                                     "(runner.strategies.SingleDeviceStrategy); allowed: none"),
    ("auto-strategy-key", ["strategy=auto", "+strategy.timeout=5"], "strategy.timeout is not a setting of strategy "
                                                                    "(runner.strategies.auto_strategy)"),
    ("accelerator-key", ["+accelerator.foo=1"], "accelerator.foo is not a setting of accelerator"),
    ("checkpoint-io-key", ["checkpoint_io=async", "+checkpoint_io.workers=2"], "checkpoint_io.workers is not a"),
    ("cluster-slurm-locally", ["cluster=slurm"], "cluster=slurm but this process was not started by srun"),
    ("task-key", ["+task.smoothing=0.1"], "task.smoothing is not a setting of task (runner.tasks.ClassificationTask)"),
    ("task-value", ["task.label_smoothing=high"], "task.label_smoothing=high is not a number"),
    ("regression-loss", ["experiment=regression", "task.loss=mae"], "task.loss=mae must be one of mse, l1, huber"),
    ("top-k-beyond-classes", ["task.top_k=[1,10]"], "task.top_k=[1, 10] asks for more than data.num_classes=4"),
    ("logger-key", ["logger.tensorboard.flushsecs=1"], "logger.tensorboard.flushsecs"),
    ("logger-value", ["logger.tensorboard.flush_secs=0"], "flush_secs=0.0 must be a positive number of seconds"),
    ("csv-file-in-a-folder", ["logger=csv", "logger.csv.filename=a/b.csv"], "must be a file name inside the run"),
    ("not-a-logger", ["+logger.mine._target_=collections.OrderedDict"], "is not a logger (it lacks log_metrics"),
    ("flat-logger-target", ["logger=none", "+logger._target_=runner.loggers.CSVLogger"],
     "each logger sits under a name of its own"),
    ("direction", ["direction=up"], "direction=up is not allowed: use minimize or maximize"),
    # -- user groups: keys against the target's signature, values by building what is cheap to build
    ("model-key", ["+model.widht=8"], "model.widht is not a setting of model (runner.models.MLP)"),
    ("model-not-importable", ["model._target_=nope.Model"], "model._target_=nope.Model cannot be imported"),
    ("model-null", ["model=null"], "model=null is not an option of model"),
    ("no-optimizer", ["~optimizer"], "optimizer is not set"),
    ("data-key", ["+data.shuffle=true"], "data.shuffle is not a setting of data (runner.data.SyntheticClassification)"),
    ("zero-batch", ["data.batch_size=0"], "data.batch_size=0 must be a positive integer"),
    ("batch-not-a-number", ["data.batch_size=abc"], "data.batch_size=abc must be a positive integer"),
    ("pin-memory-maybe", ["data.pin_memory=maybe"], "data.pin_memory=maybe must be true or false"),
    ("data-seed-overflow", ["data.seed=99999999999999999999"], "data.seed=99999999999999999999 must be an integer"),
    ("data-refuses-a-value", ["data.num_samples=0"], "data.num_samples=0 must be a positive integer"),
    ("optimizer-key", ["+optimizer.lrr=0.1"], "optimizer.lrr is not a setting of optimizer (torch.optim.AdamW)"),
    ("negative-lr", ["optimizer.lr=-1"], "optimizer.lr=-1"),
    ("negative-momentum", ["optimizer=sgd", "optimizer.momentum=-1"], "optimizer.momentum=-1"),
    ("optimizer-not-importable", ["optimizer._target_=torch.optim.Nope"], "optimizer._target_=torch.optim.Nope"),
    ("scheduler-key", ["scheduler=step", "+scheduler.foo=1"], "scheduler.foo is not a setting of scheduler"),
    ("scheduler-gamma-text", ["scheduler=step", "scheduler.gamma=fast"], "scheduler.gamma=fast"),
    ("warmup-negative", ["scheduler=warmup_cosine", "scheduler.warmup_steps=-1"],
     "scheduler.warmup_steps=-1 must be 0 or a positive number"),
    ("metric-not-a-metric", ["+metrics.f1._target_=collections.OrderedDict"], "is not a metric"),
    # A width taken from a data setting that the user's data does not have.
    ("interpolation-to-nothing", ["model.in_features=${{data.width}}"],  # braces doubled for str.format
     "model.in_features=${{data.width}} cannot be worked out: Interpolation key 'data.width' not found"),
    ("fsdp-shard-class", ["strategy=fsdp", "strategy.shard=[Block]"],
     "strategy.shard=Block: the model (MLP) has no submodule of that class; it has Sequential, Linear, ReLU"),
    ("fsdp-checkpointing-class", ["strategy=fsdp", "strategy.activation_checkpointing=[Linear,Attention]"],
     "strategy.activation_checkpointing=Attention: the model (MLP) has no submodule of that class"),
    ("fsdp-with-a-ddp-setting", ["strategy=fsdp", "+strategy.find_unused_parameters=true"],
     "strategy.find_unused_parameters=True is a setting of DistributedDataParallel (strategy=ddp); strategy=fsdp"),
    ("fsdp-state-dict-type", ["strategy=fsdp", "strategy.state_dict_type=half"],
     "strategy.state_dict_type=half must be one of sharded, full"),
    ("compile-argument", ["trainer.compile={{modee:default}}"], "got an unexpected keyword argument 'modee'"),
    ("unknown-experiment", ["experiment=nope"], "experiment=nope is not an option of experiment: charlm, digits,"),
]


# Under pytest -n, the module's tests stay in one test process, which runs this fixture once for all.
pytestmark = pytest.mark.xdist_group("bad_input")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corrupt file, and a checkpoint of the tiny run trained with SGD (whose state AdamW cannot continue)."""
    tmp = tmp_path_factory.mktemp("bad_input")
    (tmp / "corrupt.ckpt").write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    runner.fit(runner.compose([*BASE, "optimizer=sgd", "trainer.max_steps=2"]), run_dir=tmp / "sgd")
    (tmp / "sgd" / "checkpoints" / "last.ckpt").rename(tmp / "sgd.ckpt")
    (tmp / "taken").mkdir()
    (tmp / "taken" / "tensorboard").write_text("a file where the run's TensorBoard folder goes")
    return tmp


def files_under(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} if folder.exists() else set()


def written_beyond_hydra(run_dir: Path) -> set[str]:
    return {f for f in files_under(run_dir) if not f.startswith(".hydra/") and f != "runner.log"}


def test_the_matrix_holds_at_least_40_cases() -> None:
    assert len(BAD_INPUT) >= 40
    assert len({name for name, _, _ in BAD_INPUT}) == len(BAD_INPUT)


@pytest.mark.parametrize(("name", "overrides", "expected"), BAD_INPUT, ids=[case[0] for case in BAD_INPUT])
def test_bad_input_exits_1_with_one_line_naming_the_key(name: str, overrides: list[str], expected: str,
                                                        scratch: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU, whatever this is
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    run_dir = tmp_path / "run"
    args = [*BASE, *(o.format(tmp=scratch) for o in overrides), f"hydra.run.dir={run_dir}"]
    code, output = run_main(args, monkeypatch, capsys)
    expected = expected.format(tmp=scratch)
    assert code == 1, output
    assert "Traceback" not in output, output
    assert any(expected in line for line in output.splitlines()), output
    assert written_beyond_hydra(run_dir) == set(), "nothing beyond Hydra's own folder may be written"


def test_removed_groups_and_unknown_keys_fail_at_composition() -> None:
    for overrides, expected in ((["+trainer.devicez=2"], "trainer.devicez is not a trainer setting"),
                                (["+seed=42"], "seed is not a top-level key"),
                                (["~scheduler"], "scheduler is not set"),
                                (["logger=null"], "logger=null is not an option of logger")):
        with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
            runner.compose(overrides)


def test_the_users_own_keys_have_a_free_form_slot(tmp_path: Path) -> None:
    cfg = runner.compose([*BASE, "+extras.project=demo", "+extras.owner.team=vision", "tags=[baseline,small]",
                          "notes=first try", "trainer.max_steps=2"])
    metrics = runner.fit(cfg, run_dir=tmp_path / "run")
    assert metrics["step"] == 2
    resolved = (tmp_path / "run" / ".hydra" / "resolved.yaml").read_text()
    assert "project: demo" in resolved and "- baseline" in resolved and "notes: first try" in resolved


# The same through a real `python -m runner` process: what a shell user sees.
SUBPROCESS_CASES = ["seed-overflow", "step-size-zero", "find-unused-maybe", "logger-null", "unknown-ddp-argument",
                    "model-narrower-than-data"]


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_bad_input_through_the_command_line(name: str, tmp_path: Path) -> None:
    import subprocess

    (_, overrides, expected), = [case for case in BAD_INPUT if case[0] == name]
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "runner", *BASE, *overrides, f"hydra.run.dir={run_dir}"],
                            cwd=tmp_path, env={**clean_environ(), "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert any(expected in line for line in result.stderr.splitlines()), result.stderr
    assert written_beyond_hydra(run_dir) == set()


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_a_run_folder_hydra_cannot_create_is_one_line(mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    """A file in the folder's path here; a read-only file system reads the same (as root, only that one can be)."""
    (tmp_path / "afile").write_text("")
    key = "hydra.run.dir" if mode == "run" else "hydra.sweep.dir"
    args = [*(["-m", "trainer.max_steps=2,3"] if mode == "sweep" else []), *BASE, f"{key}={tmp_path / 'afile' / 'run'}"]
    code, output = run_main(args, monkeypatch, capsys)
    assert code == 1, output
    assert "Traceback" not in output, output
    assert f"{key}={tmp_path / 'afile' / 'run'} cannot be created or written: {tmp_path / 'afile'} is a file" in output
