"""Values that would wreck training, and inputs that used to end in a traceback, are one line before any worker
starts: learning-rate schedules, process group backends, models with nothing to train, samples that do not form
a batch, YAML errors in a config folder, and a run folder on a full disk. Cases run `runner.cli.main` in-process;
a handful go through `python -m runner` as a user types it."""

from __future__ import annotations

import errno
import math
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

import runner
from conftest import TINY, clean_environ, compose_config, run_main
from runner import cli
from runner.config import ConfigError
from runner.schedulers import cosine, learning_rates, schedule_problem

TESTS_DIR = Path(__file__).resolve().parent
BASE = [*(o for o in TINY if not o.startswith("logger.")), "logger=none"]
DDP = ["strategy=ddp", "trainer.devices=2"]

# (id, overrides, text one line of stderr must hold)
REFUSED = [
    ("negative-gamma", ["scheduler=step", "scheduler.gamma=-1", "scheduler.step_size=2", "trainer.max_steps=10"],
     "scheduler (torch.optim.lr_scheduler.StepLR: scheduler.step_size=2, scheduler.gamma=-1) with "
     "optimizer.lr=0.003: the learning rate is -0.003 at step 3 of the run's 10: it must stay positive"),
    ("negative-step-size", ["scheduler=step", "scheduler.step_size=-1"],
     "scheduler.step_size=-1 must be a number of optimizer steps, at least 1 (torch.optim.lr_scheduler.StepLR)"),
    ("growing-tenfold", ["scheduler=step", "scheduler.gamma=10", "scheduler.step_size=1"],
     "with optimizer.lr=0.003: the learning rate rises to 0.3 at step 3 of the run's 3, over 10x the "
     "configured 0.003: a schedule may rise to 10x at most"),
    ("factor-zero", ["scheduler=constant", "scheduler.factor=0"],
     "scheduler (torch.optim.lr_scheduler.ConstantLR: scheduler.factor=0, scheduler.total_iters=0) with "
     "optimizer.lr=0.003: the learning rate is 0 for the whole run (3 optimizer steps): nothing trains"),
    ("cosine-ends-early", ["scheduler=cosine", "+scheduler.total_steps=2", "trainer.max_steps=10"],
     "the learning rate is 0 from step 3 to the run's last step 10: 8 of its 10 optimizer steps train nothing "
     "(scheduler.total_steps=2, the run 10: leave scheduler.total_steps out"),
    # The run's length from the data, as the workers count it: 2 epochs of 256 samples at 16 x 2 processes.
    ("steps-counted-from-the-data", [*DDP, "trainer.max_steps=-1", "trainer.max_epochs=2", "scheduler=step",
                                     "scheduler.gamma=0", "scheduler.step_size=1"],
     "the learning rate is 0 from step 2 to the run's last step 16"),
    ("nccl-on-cpu", [*DDP, "strategy.process_group_backend=nccl"],
     "strategy.process_group_backend=nccl does not run on cpu (nccl runs on cuda); allowed with "
     "accelerator=cpu: gloo, or null"),
    ("misspelt-backend", [*DDP, "strategy.process_group_backend=glo"],
     "strategy.process_group_backend=glo is not a process group backend (did you mean gloo?)"),
    ("backend-for-another-device", [*DDP, "strategy.process_group_backend='cuda:nccl'"],
     "strategy.process_group_backend=cuda:nccl names no backend for cpu"),
    ("frozen-model", ["model._target_=trust_data.FrozenModel"],
     "model (trust_data.FrozenModel) has no trainable parameters: all 2 have requires_grad=False"),
    ("model-without-parameters", ["model._target_=trust_data.NoParameters"],
     "model (trust_data.NoParameters) has no parameters: the optimizer would get an empty list"),
    ("none-samples", ["data._target_=trust_data.NoneSamples"],
     "data (trust_data.NoneSamples): the first 4 samples of train_dataset do not form a batch with the default "
     "collate: TypeError: default_collate: batch must contain tensors"),
    ("ragged-samples", ["data._target_=trust_data.RaggedSamples"],
     "data (trust_data.RaggedSamples): the first 4 samples of train_dataset do not form a batch with the default "
     "collate: RuntimeError: stack expects each tensor to be equal size, but got [3] at entry 0 and [4] at "
     "entry 1; give the data a collate_fn"),
    ("ragged-validation-samples", ["data._target_=trust_data.RaggedValidation"],
     "the first 4 samples of val_dataset do not form a batch with the default collate"),
]


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, capture_output=True, text=True,
                          env={**clean_environ(), "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(TESTS_DIR)},
                          timeout=120)


def assert_one_line(code: int, output: str, expected: str) -> None:
    assert code == 1, output
    assert "Traceback" not in output, output
    assert any(expected in line for line in output.splitlines()), output


@pytest.mark.parametrize(("name", "overrides", "expected"), REFUSED, ids=[case[0] for case in REFUSED])
def test_refused_before_any_worker_starts(name: str, overrides: list[str], expected: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "run"
    code, output = run_main([*BASE, *overrides, f"hydra.run.dir={run_dir}"], monkeypatch, capsys)
    assert_one_line(code, output, expected)
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.json").exists()


# What a shell user sees, in a real process: the cosine, backend and ragged-data cases.
@pytest.mark.parametrize("name", ["cosine-ends-early", "nccl-on-cpu", "ragged-samples"])
def test_refused_through_the_command_line(name: str, tmp_path: Path) -> None:
    (_, overrides, expected), = [case for case in REFUSED if case[0] == name]
    result = run_cli([*BASE, *overrides, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert_one_line(result.returncode, result.stdout + result.stderr, expected)
    assert "rank" not in result.stderr  # no worker started


@pytest.mark.parametrize("overrides", [
    ["scheduler=cosine"],  # decays to 0 at the run's end: its last step still trains
    ["scheduler=linear", "scheduler.warmup_steps=1"],
    ["scheduler=warmup_cosine", "scheduler.warmup_steps=1"],
    ["scheduler=step", "scheduler.gamma=10", "scheduler.step_size=2"],  # 10x, not more, within the run
    # OneCycleLR sets its own rates, peaking at max_lr whatever optimizer.lr says.
    ["scheduler._target_=torch.optim.lr_scheduler.OneCycleLR", "~scheduler.factor", "~scheduler.total_iters",
     "+scheduler.max_lr=0.1", "+scheduler.total_steps=3"],
    ["data._target_=trust_data.RaggedWithCollate", "model.in_features=3", "data.batch_size=4"],
    [*DDP, "strategy.process_group_backend=gloo"],
], ids=["cosine", "linear", "warmup-cosine", "tenfold", "one-cycle", "collate-fn", "gloo"])
def test_sound_settings_pass(overrides: list[str]) -> None:
    from runner.checks import validate

    validate(compose_config([*BASE, *overrides]))


def test_a_collate_fn_that_batches_ragged_samples_trains(tmp_path: Path) -> None:
    cfg = compose_config([*BASE, "data._target_=trust_data.RaggedWithCollate", "model.in_features=3",
                          "data.batch_size=4", "trainer.max_steps=2"])
    assert runner.fit(cfg, run_dir=tmp_path / "run")["step"] == 2


def test_a_frozen_model_may_still_be_evaluated() -> None:
    from runner.checks.components import check_trainable
    from runner.plan import Plan

    frozen = [*BASE, "model._target_=trust_data.FrozenModel"]
    assert list(check_trainable(Plan(compose_config([*frozen, "stage=validate"])))) == []
    assert len(list(check_trainable(Plan(compose_config(frozen))))) == 1


def optimizer(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_the_rates_are_those_each_step_trains_with() -> None:
    rates = learning_rates(cosine(optimizer(), 4), 4)
    assert rates == pytest.approx([0.1 * (1 + math.cos(math.pi * i / 4)) / 2 for i in range(4)])
    assert schedule_problem(rates, 4, 0.1) is None  # reaches 0 after the last step: a decay's end


def test_zero_at_the_last_step_alone_is_a_decays_end() -> None:
    assert schedule_problem([0.1, 0.05, 0.0], 3, 0.1) is None
    assert schedule_problem([0.1, 0.0, 0.0], 3, 0.1) == ("the learning rate is 0 from step 2 to the run's last step "
                                                         "3: 2 of its 3 optimizer steps train nothing")
    assert schedule_problem([0.0, 0.1, 0.1], 3, 0.1) is None  # a warm-up from 0


def test_non_finite_and_negative_rates_are_refused() -> None:
    assert "is nan at step 2" in schedule_problem([0.1, math.nan], 2, 0.1)
    assert "is -0.1 at step 1" in schedule_problem([-0.1, 0.1], 2, 0.1)
    # The first step that goes wrong is named: a rise that later overflows to inf is a rise.
    assert "rises to 10 at step 2 of the run's 3" in schedule_problem([0.1, 10.0, math.inf], 3, 0.1)


def test_a_prefix_of_a_long_run_judges_no_zero_tail() -> None:
    """Beyond the probed steps nothing is known: a prefix ending at 0 may rise again (a cycle)."""
    assert schedule_problem([0.1, 0.0, 0.0], 300_000, 0.1) is None
    assert schedule_problem([0.0, 0.0], 300_000, 0.1) == ("the learning rate is 0 for the first 2 steps of the "
                                                          "run's 300000: nothing trains")


def test_a_long_run_is_probed_over_a_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the probed steps nothing is said: a rise at step 7 of 10 goes unseen when 5 are probed."""
    from runner.checks import schedule, validate

    cfg = compose_config([*BASE, "scheduler=step", "scheduler.gamma=100", "scheduler.step_size=6",
                          "trainer.max_steps=10"])
    with pytest.raises(ConfigError, match="rises to 0.3 at step 7 of the run's 10"):
        validate(cfg)
    monkeypatch.setattr(schedule, "_PROBED_STEPS", 5)
    validate(cfg)


# -- a YAML error in the user's config folder --------------------------------------------------------------

def broken_config_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "conf" / "model"
    folder.mkdir(parents=True)
    (folder / "broken.yaml").write_text("_target_: runner.models.MLP\nin_features: [8, 16\nhidden: 16\n")
    (folder / "tabbed.yaml").write_text("_target_: runner.models.MLP\n\thidden: 16\n")
    return tmp_path / "conf"


def test_a_yaml_error_in_a_config_folder_is_one_line_with_file_and_line(tmp_path: Path) -> None:
    conf = broken_config_dir(tmp_path)
    result = run_cli(["--config-dir", str(conf), "model=broken", *BASE, f"hydra.run.dir={tmp_path / 'run'}"],
                     cwd=tmp_path)
    assert_one_line(result.returncode, result.stdout + result.stderr,
                    f"{conf / 'model' / 'broken.yaml'}:3:7: not valid YAML: expected ',' or ']', but got ':' "
                    "(while parsing a flow sequence at line 2)")
    assert len(result.stderr.splitlines()) <= 4, result.stderr


def test_compose_names_the_file_and_line_of_a_yaml_error(tmp_path: Path) -> None:
    conf = broken_config_dir(tmp_path)
    with pytest.raises(ConfigError, match=r"tabbed\.yaml:2:1: not valid YAML: found character '\\t'"):
        runner.compose(["model=tabbed"], config_dir=conf)
    assert runner.compose([*BASE], config_dir=conf).model.hidden == 16  # a broken file not chosen is not read


# -- a run folder on a full disk ---------------------------------------------------------------------------

def test_a_full_disk_is_named_with_the_folder() -> None:
    reason = cli.write_error_reason(Path("/data/run"), OSError(errno.ENOSPC, "No space left on device"))
    assert reason == ("no space left in /data/run (No space left on device): free some space there, or choose a "
                      "folder on another disk")
    assert cli.write_error_reason(Path("/data/run"), OSError(errno.EROFS, "")) == \
        "/data/run is on a read-only file system"


def test_a_run_folder_on_a_full_disk_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        (disk / "fill").write_bytes(bytes(60 * 1024))  # the rest of the 64k disk's blocks
        code, output = run_main([*BASE, f"hydra.run.dir={disk / 'run'}"], monkeypatch, capsys)
        assert_one_line(code, output, f"hydra.run.dir={disk / 'run'} cannot be created or written: no space left "
                                      f"in {disk / 'run'}")
        assert sorted(p.name for p in disk.iterdir()) == ["fill"]  # the folder made to find out is gone
    finally:
        subprocess.run(["umount", str(disk)], check=False)
