"""Every option of every config group composes, validates and builds; bad settings give the message users see."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from hydra.utils import get_method
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ValidationError

from runner.config import ConfigError, unique_dir
from runner.data import train_loader
from runner.build import (build_data, build_logger, build_model, build_optimizer, build_scheduler, build_strategy,
                          build_task)
from runner.checks import validate
from runner.loggers import NullLogger
from runner.precision import Precision
from runner.tasks import TaskModule
from runner.strategies import Strategy
from conftest import CONF_DIR, compose_config

CUDA = torch.cuda.is_available()


def all_options() -> list[tuple[str, str]]:
    """(group, option) for every option file under conf/, so a new file is tested without editing this list."""
    return sorted((group.name, path.stem) for group in CONF_DIR.iterdir() if group.is_dir()
                  for path in group.glob("*.yaml"))


# Options that cannot run on a machine without a GPU, and the message they must give there instead.
NEEDS_CUDA = {
    ("accelerator", "cuda"): "accelerator=cuda but no CUDA device is available here",
    ("precision", "16-mixed"): "precision=16-mixed needs accelerator=cuda",
}

# What an option needs beside it to run: float16 parameters need an Adam epsilon that float16 can hold.
# A task needs a model and data of its kind.
COMPANIONS = {
    ("precision", "16-true"): ["++optimizer.eps=1e-4"],
    ("task", "regression"): ["experiment=regression"],
    ("data", "synthetic_regression"): ["experiment=regression"],
    ("task", "language_model"): ["experiment=charlm"],
    ("task", "model"): ["experiment=hf_style"],
}

# Options that need a Hydra plugin (an optional extra), by the module it installs.
NEEDS_PLUGIN = {("hparams_search", "optuna"): "hydra_plugins.hydra_optuna_sweeper", ("logger", "mlflow"): "mlflow",
                ("logger", "wandb"): "wandb", ("experiment", "tiny_gpt2"): "transformers",
                ("experiment", "tiny_bert"): "transformers"}

# Options that read who started the processes from the environment: one process, rank 0.
ENVIRONMENTS = {
    "torchelastic": {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "test"},
    "slurm": {"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
              "SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_NODELIST": "node1"},
}


def test_the_option_list_covers_every_group() -> None:
    groups = {group for group, _ in all_options()}
    assert {"strategy", "accelerator", "precision", "checkpoint_io", "cluster", "model", "data", "optimizer",
            "scheduler", "logger", "task", "trainer", "experiment", "hparams_search"} <= groups
    assert {"auto", "single", "dp", "ddp", "fsdp"} <= {o for g, o in all_options() if g == "strategy"}


def _assert_built_as_targeted(obj: object, node: DictConfig) -> None:
    """A `_target_` that names a class yields an instance of it (factories such as auto_* may pick one)."""
    target = get_method(node._target_)
    if inspect.isclass(target):
        assert isinstance(obj, target), f"{node._target_} built a {type(obj).__name__}"


@pytest.mark.parametrize(("group", "option"), all_options(), ids=[f"{g}={o}" for g, o in all_options()])
def test_option_composes_validates_and_builds(group: str, option: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in ENVIRONMENTS.get(option if group == "cluster" else "", {}).items():
        monkeypatch.setenv(key, value)
    # max_steps: the steps the schedulers decay over (the worker counts them; here they are given).
    if (group, option) in NEEDS_PLUGIN and importlib.util.find_spec(NEEDS_PLUGIN[group, option]) is None:
        pytest.skip(f"{group}={option} needs {NEEDS_PLUGIN[group, option]}")
    cfg = compose_config([f"{group}={option}", "trainer.max_steps=10", *COMPANIONS.get((group, option), [])])
    if group not in ("experiment", "hparams_search"):  # `# @package _global_` presets have no node of their own
        assert cfg[group] is not None
    if (group, option) in NEEDS_CUDA and not CUDA:
        with pytest.raises(ConfigError, match=NEEDS_CUDA[group, option]):
            validate(cfg)
        return
    validate(cfg)
    strategy = build_strategy(cfg)
    try:
        assert isinstance(strategy, Strategy)
        model = build_model(cfg)
        data = build_data(cfg)
        optimizer = build_optimizer(cfg, model)  # named optimizers take the model's parameters by name
        scheduler = build_scheduler(cfg, optimizer, total_steps=10)
        task = build_task(cfg)
        logger = build_logger(cfg, tmp_path, enabled=True)
        built = {"strategy": strategy, "model": model, "data": data, "task": task, "logger": logger,
                 "optimizer": optimizer, "scheduler": scheduler}
        if group == "optimizer" and "_target_" not in cfg.optimizer:  # several named optimizers, one each
            for part, node in zip(optimizer.optimizers, cfg.optimizer.values()):
                assert type(part) is get_method(node._target_)
        elif group in built and group != "logger" and not cfg[group].get("_partial_", False):
            _assert_built_as_targeted(built[group], cfg[group])
        if group == "logger":  # each option sits under its own name, logger.<option>; none is no logger at all
            if option == "none":
                assert isinstance(logger, NullLogger) and not cfg.logger
            else:
                _assert_built_as_targeted(logger, cfg.logger[option])
        assert isinstance(optimizer, torch.optim.Optimizer)
        assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
        # The pieces fit together: one batch of the data through the model and its task.
        out = TaskModule(model, task, Precision())(next(iter(train_loader(data, None, seed=0))))
        assert out["loss"].ndim == 0 and torch.isfinite(out["loss"])
        assert out["stats"].shape == (1, len(task.stat_names))
        logger.finalize()
    finally:
        strategy.teardown()


def test_cfg_fixture_is_a_tiny_cpu_run(cfg: DictConfig) -> None:
    validate(cfg)
    assert cfg.accelerator._target_.endswith("CPUAccelerator")
    assert cfg.trainer.max_steps == 3 and cfg.data.batch_size == 16
    # Interpolations follow the data: the model's input width is the data's feature count.
    assert cfg.model.in_features == cfg.data.num_features == 8


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.devices=abc"], "trainer.devices=abc is not allowed"),
    (["trainer.devices=0"], "trainer.devices=0 is not allowed"),
    (["trainer.devices=[0,-1]"], "trainer.devices=[0, -1] is not allowed"),
    (["trainer.num_nodes=0"], "trainer.num_nodes=0 must be a positive integer"),
    (["cluster=local", "trainer.num_nodes=2"], "trainer.num_nodes=2 needs processes started by a cluster"),
    (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0 must be a positive integer"),
    (["trainer.max_steps=0"], "trainer.max_steps=0 must be a positive integer, or -1"),
    (["trainer.max_epochs=-1", "trainer.max_steps=-1"], "would train forever"),
    (["trainer.gradient_clip_val=0"], "trainer.gradient_clip_val=0.0 must be a positive number"),
    (["trainer.ckpt_every_n_steps=0"], "trainer.ckpt_every_n_steps=0 must be a positive integer"),
    (["trainer.keep_last_k=0"], "trainer.keep_last_k=0 must be a positive integer, or null to keep every periodic "
                                "checkpoint (step-000020.ckpt: the step in 6 digits)"),
    (["trainer.limit_train_batches=1.5"], "trainer.limit_train_batches=1.5 is not allowed"),
    (["trainer.limit_train_batches=0"], "trainer.limit_train_batches=0 is not allowed"),
    (["trainer.val_check_interval=0.0"], "trainer.val_check_interval=0.0 is not allowed"),
    (["trainer.fast_dev_run=-1"], "trainer.fast_dev_run=-1 must be true, false or a number"),
    (["data.batch_size=0"], "data.batch_size=0 must be a positive integer"),
    (["model._target_=nope.Model"], "model._target_=nope.Model cannot be imported"),
    (["optimizer._target_=torch.optim.Nope"], "optimizer._target_=torch.optim.Nope cannot be imported"),
    (["scheduler=warmup_cosine", "+scheduler.warmup=5"], "scheduler.warmup is not a setting of scheduler (runner.schedulers.warmup_cosine) (did you mean warmup_steps?)"),
    (["accelerator=cpu", "precision=16-mixed"], "precision=16-mixed needs accelerator=cuda"),
    (["precision=16-true"], "precision=16-true with optimizer eps=1e-08: float16 rounds it to 0"),
    (["accelerator=cpu", "strategy=single", "trainer.devices=2"], "needs strategy=ddp or strategy=dp"),
    (["accelerator=cpu", "strategy=dp", "trainer.devices=2"], "needs accelerator=cuda for strategy=dp"),
    (["strategy=ddp", "strategy.start_method=thread"], "strategy.start_method=thread must be one of popen, spawn, fork, forkserver"),
    (["strategy=ddp", "strategy.timeout=0"], "strategy.timeout=0.0 must be a positive number"),
    (["trainer.compile=fast"], "trainer.compile=fast must be true, false, or torch.compile's keyword arguments"),
    (["trainer.compile={modee:default}"], "got an unexpected keyword argument 'modee' (torch.compile takes"),
    (["strategy=dp", "trainer.compile=true"], "trainer.compile needs strategy=single or strategy=ddp"),
])
def test_bad_setting_names_the_key(overrides: list[str], message: str) -> None:
    cfg = compose_config(["trainer.max_steps=10", *overrides])
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert message in str(error.value)


def test_every_problem_is_reported_at_once() -> None:
    cfg = compose_config(["trainer.devices=abc", "data.batch_size=0", "trainer.gradient_clip_val=-1"])
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert len(error.value.problems) == 3
    assert str(error.value).startswith("invalid config (3 problems):")


def test_cuda_without_a_gpu_names_the_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="accelerator=cuda but no CUDA device is available"):
        validate(compose_config(["accelerator=cuda"]))


@pytest.mark.parametrize(("option", "world_size"), [("torchelastic", "2"), ("slurm", "3")])
def test_external_launch_must_match_devices_times_nodes(option: str, world_size: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    size_key = "WORLD_SIZE" if option == "torchelastic" else "SLURM_NTASKS"
    for key, value in {**ENVIRONMENTS[option], size_key: world_size}.items():
        monkeypatch.setenv(key, value)
    cfg = compose_config([f"cluster={option}", "accelerator=cpu", "trainer.devices=1"])
    with pytest.raises(ConfigError, match=f"= 1 processes, but .* started {world_size}"):
        validate(cfg)


def test_missing_and_corrupt_checkpoints_name_the_key(cfg: DictConfig, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.ckpt_path=/missing.ckpt: checkpoint not found"):
        validate(cfg, "/missing.ckpt")
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(ConfigError, match=f"trainer.ckpt_path={corrupt}: cannot load checkpoint"):
        validate(cfg, corrupt)
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(ConfigError, match="is not a runner checkpoint: it lacks model, optimizer, step"):
        validate(cfg, foreign)


@pytest.mark.parametrize(("override", "error"), [
    ("strategy=nonexistent", ConfigCompositionException),
    ("trainer.devicez=2", ConfigCompositionException),
    ("trainer.max_steps=abc", (ConfigCompositionException, ValidationError)),
])
def test_unknown_option_or_key_fails_to_compose(override: str, error: type) -> None:
    with pytest.raises(error):
        compose_config([override])


def test_schema_rejects_keys_outside_trainer_schema() -> None:
    cfg = compose_config()
    with pytest.raises(ConfigAttributeError, match="Key .devicez. not in .TrainerConfig."):
        cfg.trainer.devicez = 2


def test_unique_dir_adds_a_suffix_when_the_folder_exists(tmp_path: Path) -> None:
    taken = tmp_path / "12-00-00"
    taken.mkdir()
    first = unique_dir(str(taken))
    assert first == f"{taken}-1" and Path(first).is_dir()
    # Hydra resolves the run dir more than once per run: the same answer each time.
    assert unique_dir(str(taken)) == first
    assert unique_dir(str(tmp_path / "12-00-01")) == str(tmp_path / "12-00-01")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["+optimizer.lrr=0.1"], "optimizer.lrr is not a setting of optimizer (torch.optim.AdamW) (did you mean lr?)"),
        (["scheduler=step", "+scheduler.foo=1"], "scheduler.foo is not a setting of scheduler "
                                                  "(torch.optim.lr_scheduler.StepLR); allowed: gamma, last_epoch"),
        (["logger.tensorboard.flush_secs=0"], "logger.tensorboard (runner.loggers.TensorBoardLogger) does not "
                                               "accept its settings: ValueError: flush_secs=0.0 must be a positive"),
        (["logger=csv", "logger.csv.filename=a/b.csv"], "logger.csv (runner.loggers.CSVLogger) does not accept its "
                                                         "settings: ValueError: filename='a/b.csv' must be a file"),
        (["+logger.mine._target_=collections.OrderedDict"], "logger.mine._target_=collections.OrderedDict is not a "
                                                            "logger (it lacks log_metrics, resume_at"),
        (["cluster=slurm"], "cluster=slurm but this process was not started by srun"),
        (["cluster=torchelastic"], "cluster=torchelastic but this process was not started by torchrun"),
    ],
)
def test_training_objects_and_clusters_are_checked_before_any_worker(overrides: list, expected: str) -> None:
    from runner.checks import validate

    with pytest.raises(ConfigError) as error:
        validate(compose_config(overrides))
    assert expected in str(error.value)


def test_a_value_the_optimizer_refuses_is_a_config_error(tmp_path: Path) -> None:
    import runner

    cfg = compose_config(["optimizer.lr=-1", "trainer.max_steps=2", "strategy=single"])
    with pytest.raises(ConfigError, match=r"optimizer \(torch.optim.AdamW\) does not accept its settings \(optimizer.lr=-1, .*\): ValueError"):
        runner.fit(cfg, run_dir=tmp_path)
