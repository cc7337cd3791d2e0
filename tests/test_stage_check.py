"""`stage=check`: every check, the model and task on the meta device over the first batch's shapes, what the run
would hold per process; nothing launched, trained or written. `-m stage=check` over experiments, `runner.testing`."""

from __future__ import annotations

import csv
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import runner
import runner.testing
from conftest import REPO, clean_environ, run_main
from runner.config import ConfigError
from runner.testing import check_config, config_cases
from setup_counting_data import read_calls

TESTS = Path(__file__).resolve().parent
DDP8 = ("stage=check", "strategy=ddp", "accelerator=cpu", "trainer.devices=8")


@pytest.fixture(autouse=True)
def _runner_log_as_a_new_process_has_it():
    """The report is a line of the runner's logger, which reaches the console through Hydra's handlers, as in a
    new process: a run an earlier module's fixture made in this process may have left the logger writing to that
    fixture's console instead."""
    log = logging.getLogger("runner")
    saved = (list(log.handlers), log.propagate, log.level)
    log.handlers, log.propagate, log.level = [], True, logging.NOTSET
    yield
    log.handlers, log.propagate, log.level = saved


def test_check_reports_parameters_flops_and_memory_per_process(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = run_main([*DDP8, "data.num_features=32", "model.hidden=128", "model.depth=2", "data.num_classes=4"],
                         monkeypatch, capsys)
    assert code == 0, out
    # 32*128+128 + 128*128+128 + 128*4+4 = 21252 parameters, 4 bytes each, AdamW: 2 states each.
    assert "check: ok — model 21.3k parameters (21.3k trainable)" in out
    assert "GFLOP per sample; per process (ddp, 8 processes, 32-true): weights 83 KiB, gradients 83 KiB, " \
           "optimizer state 166 KiB" in out
    assert list(tmp_path.iterdir()) == []  # no run folder, no outputs/


def test_a_shape_mismatch_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["stage=check", "model.in_features=31", "data.num_features=32"], monkeypatch, capsys)
    assert code == 1
    assert "model (runner.models.MLP) does not take the batches of data" in out and "Traceback" not in out
    assert "model.in_features=31" in out and "data.num_features=32" in out


def test_every_problem_is_listed_and_nothing_runs(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["stage=check", "model._target_=runner.models.NoSuchNet", "trainer.max_steps=0"],
                         monkeypatch, capsys)
    assert code == 1
    assert "model._target_=runner.models.NoSuchNet cannot be imported" in out
    assert "trainer.max_steps=0 must be a positive integer" in out
    assert list(tmp_path.iterdir()) == []


def test_the_checkpoint_is_checked_when_set(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["stage=check", f"trainer.ckpt_path={tmp_path / 'missing.ckpt'}"], monkeypatch, capsys)
    assert code == 1 and "missing.ckpt" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the GPUs: nothing is skipped")
def test_cuda_devices_this_machine_lacks_skip_the_device_check_only(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["stage=check", "accelerator=cuda", "strategy=ddp", "trainer.devices=8",
                          "precision=bf16-mixed"], monkeypatch, capsys)
    assert code == 0, out
    assert "this machine has 0 CUDA device(s), so the device check was skipped" in out
    assert "per process (ddp, 8 processes, bf16-mixed)" in out
    # The rest is still checked: strategy=single cannot take 8 devices.
    code, out = run_main(["stage=check", "accelerator=cuda", "strategy=single", "trainer.devices=8"],
                         monkeypatch, capsys)
    assert code == 1 and "needs strategy=ddp or strategy=dp" in out


def test_fsdp_shards_and_sgd_keeps_one_state() -> None:
    fsdp = check_config(["strategy=fsdp", "accelerator=cpu", "trainer.devices=2", "optimizer=sgd",
                         "optimizer.momentum=0.9", "precision=bf16-true"])
    n = fsdp["parameters"]
    assert (fsdp["strategy"], fsdp["world_size"]) == ("fsdp", 2)
    assert fsdp["weights_bytes"] == n * 2 / 2 and fsdp["optimizer_state_bytes"] == n * 2 / 2
    ddp = check_config(["strategy=ddp", "accelerator=cpu", "trainer.devices=2", "optimizer=adamw"])
    assert ddp["weights_bytes"] == n * 4 and ddp["optimizer_state_bytes"] == 2 * n * 4


def test_named_optimizers_keep_each_its_own_states_over_its_part() -> None:
    """optimizer=parts: AdamW's two states over the hidden layers, SGD's momentum over the classifier (net.4)."""
    found = check_config(["optimizer=parts", "accelerator=cpu", "model.depth=2", "model.hidden=128"])
    classifier = 128 * 4 + 4  # net.4: 128 x 4 weights and 4 biases
    hidden = found["parameters"] - classifier
    assert found["optimizer_state_bytes"] == (2 * hidden + classifier) * 4


def test_a_sweep_preset_is_checked_as_one_config(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["stage=check", "experiment=lr_sweep"], monkeypatch, capsys)
    assert code == 0, out
    assert out.count("check: ok") == 1 and "Launching" not in out
    assert list(tmp_path.iterdir()) == []


def test_a_data_module_is_set_up_only_by_check_data(tmp_path: Path) -> None:
    conf = tmp_path / "conf" / "data"
    conf.mkdir(parents=True)
    (tmp_path / "calls").mkdir()
    (conf / "counting.yaml").write_text(f"_target_: setup_counting_data.CountingModule\nfolder: {tmp_path / 'calls'}\n"
                                        "batch_size: 16\nnum_features: 8\nnum_samples: 64\n")
    overrides = ["data=counting", "model.in_features=8", "model.num_classes=2"]
    found = check_config(overrides, config_dir=tmp_path / "conf")
    assert found["gflop_per_sample"] is None and "stage=check_data" in found["report"]
    assert {call[0] for call in read_calls(tmp_path / "calls")} <= {"init"}
    found = check_config(overrides, config_dir=tmp_path / "conf", stage="check_data")
    assert {"prepare_data", "setup"} <= {call[0] for call in read_calls(tmp_path / "calls")}
    assert found["gflop_per_sample"] > 0
    with pytest.raises(ConfigError, match="model.in_features=7"):
        check_config([*overrides, "model.in_features=7"], config_dir=tmp_path / "conf", stage="check_data")


def test_a_check_sweep_summarises_which_configs_passed(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = run_main(["-m", "stage=check", "experiment=regression,lr_sweep", "model.hidden=16,-1",
                          f"hydra.sweep.dir={tmp_path / 'sweep'}"], monkeypatch, capsys)
    assert code == 1  # one config or more failed
    with open(tmp_path / "sweep" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4  # lr_sweep is one config of the sweep, not three jobs
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["overrides"] for r in ok} == {"stage=check experiment=regression model.hidden=16",
                                            "stage=check experiment=lr_sweep model.hidden=16"}
    assert all(int(r["parameters"]) > 0 for r in ok)
    failed = [r for r in rows if r["status"] == "failed"]
    assert len(failed) == 2 and all("model.hidden=-1" in r["overrides"] and r["error"] for r in failed)
    assert "\n" not in failed[0]["error"]
    assert (tmp_path / "sweep" / "summary.md").read_text().startswith("Checked 4 config(s): 2 passed, 2 failed")


def test_config_cases_check_experiments_and_lone_options_as_the_docs_show(tmp_path: Path, monkeypatch) -> None:
    """A model made for its own data (3 features) is checked in the experiment that pairs them, not over the default
    data, where it fails without being wrong; the module's snippet runs as written."""
    conf = tmp_path / "my_conf"
    for group in ("experiment", "model", "data", "optimizer"):
        (conf / group).mkdir(parents=True)
    (conf / "experiment" / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - override /model: narrow\n"
                                                   "  - override /data: narrow\n")
    (conf / "model" / "narrow.yaml").write_text("_target_: runner.models.MLP\nin_features: 3\nhidden: 8\ndepth: 1\n"
                                                "num_classes: ${data.num_classes}\n")
    (conf / "data" / "narrow.yaml").write_text("defaults:\n  - synthetic\n  - _self_\nnum_features: 3\n")
    (conf / "optimizer" / "slow.yaml").write_text("defaults:\n  - sgd\n  - _self_\nlr: 0.001\n")
    monkeypatch.chdir(tmp_path)
    snippet = {}
    code = [line for line in runner.testing.__doc__.splitlines() if line.startswith("    ") or not line.strip()]
    exec(textwrap.dedent("\n".join(code)), snippet)
    cases = snippet["test_config"].pytestmark[0].args[1]
    assert [c.id for c in cases] == ["experiment=mine", "optimizer=slow"]
    for case in cases:
        snippet["test_config"](*case.values)
    [alone] = config_cases(conf, groups=["model"])  # asked for: each model over the default data
    with pytest.raises(ConfigError, match="model.in_features=3"):
        check_config(alone.values[0], config_dir=conf)
    assert "experiment=lr_sweep" in [c.id for c in config_cases()]  # the runner's own experiments by default


def test_stage_check_is_listed_where_stages_are(tmp_path, monkeypatch, capsys) -> None:
    code, out = run_main(["stage=train"], monkeypatch, capsys)
    assert code == 1 and "check" in out
    code, out = run_main(["--help"], monkeypatch, capsys)
    assert "stage=check" in out


def test_the_command_line_checks_without_writing(tmp_path: Path) -> None:
    env = clean_environ()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPO)])
    done = subprocess.run([sys.executable, "-m", "runner", "stage=check", "experiment=shapes"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "check: ok" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_runner_fit_checks_from_python() -> None:
    found = runner.fit(runner.compose(["stage=check"]))
    assert found["report"].startswith("check: ok") and found["parameters"] > 0


def test_the_command_ends_through_the_exit_handlers(tmp_path: Path) -> None:
    """A check skips the interpreter's teardown of the modules, not what a program registered to run at exit, nor
    the console's last lines through a pipe."""
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit, pathlib\natexit.register(lambda: pathlib.Path('exit-handler-ran').write_text('yes'))\n")
    env = clean_environ()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
    done = subprocess.run([sys.executable, "-m", "runner", "stage=check"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("check: ok") and done.stdout.endswith("\n")
    assert (tmp_path / "exit-handler-ran").read_text() == "yes"


def test_a_small_model_is_tried_on_the_cpu_without_the_meta_kernels_imports(tmp_path: Path) -> None:
    """The default model (21k parameters) passes its first batch and its FLOP count on the CPU: the check imports
    neither sympy nor torch._dynamo, which torch's meta kernels bring in at their first call; the FLOPs are those
    counted on the meta device."""
    code = ("import sys; from runner.cli import main\nsys.argv = ['runner', 'stage=check']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print(sorted(m for m in ('sympy', 'torch._dynamo') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=clean_environ(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr
    from runner.build import build_data
    from runner.flops import count_flops
    from runner.precision import Precision
    from runner.tasks import TaskModule

    cfg = runner.compose(["accelerator=cpu"])
    data = build_data(cfg)
    batch = torch.stack([data.train_dataset[i][0] for i in range(2)]), torch.tensor([0, 1])
    module = TaskModule(runner.build.build_model(cfg), runner.build.build_task(cfg), Precision())
    assert count_flops(module, batch) == count_flops(module, batch, on_meta=False) > 0


# -- streams, the first batch of data.batch_size, nested targets, a LightningModule's steps -------------------------
SMALL = ("accelerator=cpu", "data.num_samples=64", "data.val_samples=32", "data.batch_size=16", "data.num_features=8",
         "model.hidden=16", "trainer.max_steps=4")


@pytest.fixture(scope="module")
def map_style_flops() -> float:
    return check_config(SMALL)["gflop_per_sample"]


@pytest.mark.parametrize("data", ["stream_data.StreamData trainer.limit_val_batches=2",
                                  "stream_data.StreamData +data.sized=true",
                                  "stage_check_fixtures.IterableData", "stage_check_fixtures.StreamLoaderData",
                                  "stage_check_fixtures.HFStreamData"],
                         ids=["torch-stream", "sized-torch-stream", "plain-iterable", "train_dataloader", "hf-stream"])
def test_a_stream_is_checked_from_its_first_samples(data: str, map_style_flops: float) -> None:
    """The check reads a stream's first samples from its iterator, never its len() or indexing, and does with them
    what it does with a map-style set's: the model's FLOPs over them, and a model that does not take them refused."""
    if data.endswith("HFStreamData"):
        pytest.importorskip("datasets")
    target, *extra = data.split()
    overrides = [*SMALL, f"data._target_={target}", *extra]
    found = check_config(overrides)
    assert found["gflop_per_sample"] == pytest.approx(map_style_flops) and "first batch (16 samples)" in found["report"]
    with pytest.raises(ConfigError, match=r"model \(runner.models.MLP\) does not take the batches of data .*"
                                          r"model.in_features=7"):
        check_config([*overrides, "model.in_features=7"])


def test_a_stream_shorter_than_a_batch_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"data \(stage_check_fixtures.ShortStream\): train_dataset \(a stream\) "
                                          r"ended after 3 samples, fewer than one batch \(data.batch_size=16\)"):
        check_config([*SMALL, "data._target_=stage_check_fixtures.ShortStream"])


def test_a_batch_of_data_batch_size_goes_through_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that takes 2 samples but not data.batch_size of them fails the check, as its first step would: on the
    CPU (a small model), and on the meta device (a large one, shapes only)."""
    overrides = [*SMALL, "model._target_=stage_check_fixtures.AtMostFour"]
    line = r"model \(stage_check_fixtures.AtMostFour\) fails on the first batch of data.batch_size=16 samples"
    with pytest.raises(ConfigError, match=line + r", where 2 samples pass \(forward and backward, on the CPU\): "
                                                 r"RuntimeError: The size of tensor a \(16\) must match the size of "
                                                 r"tensor b \(4\)"):
        check_config(overrides)
    assert "first batch (4 samples)" in check_config([*overrides, "data.batch_size=4"])["report"]
    monkeypatch.setattr("runner.build.TRIAL_ON_CPU_PARAMETERS", 0)
    with pytest.raises(ConfigError, match=line + r" \(forward and backward, on the meta device: shapes only\): "
                                                 r"RuntimeError: .*\[4, 4\].*\[16, 4\]"):
        check_config(overrides)


LIT_MODEL = """_target_: lightning_template.LitTemplate
num_classes: 4
net:
  _target_: lightning_template.SmallCNN
  in_channels: 3
  num_classes: 4
optimizer:
  _target_: torch.optim.Adam
  _partial_: true
  lr: 0.001
  weight_decay: 0.0
scheduler:
  _target_: torch.optim.lr_scheduler.ReduceLROnPlateau
  _partial_: true
  mode: min
  patience: 10
"""
LIT = ("accelerator=cpu", "model=lit", "data=images", "trainer.max_steps=4")


@pytest.fixture
def lit_conf(tmp_path: Path) -> Path:
    """lightning-hydra-template's model config (a LightningModule with nested net, optimizer and scheduler), and
    3-channel images."""
    for group, text in (("model", LIT_MODEL), ("data", "_target_: lightning_template.ImageData\nbatch_size: 16\n")):
        (tmp_path / "conf" / group).mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / group / "lit.yaml" if group == "model" else tmp_path / "conf" / group / "images.yaml"
         ).write_text(text)
    (tmp_path / "conf" / "model" / "with_net.yaml").write_text(
        "_target_: stage_check_fixtures.WithNet\nnet:\n  _target_: runner.models.MLP\n  in_features: 32\n")
    return tmp_path / "conf"


def test_nested_targets_are_checked_against_their_signatures(lit_conf: Path) -> None:
    """A typo in a nested node (a `_partial_` optimizer of a LightningModule, a plain model's net) is one line naming
    the key and the allowed ones, as for a group's own keys."""
    from runner.checks import validate

    with pytest.raises(ConfigError) as refused:
        validate(runner.compose([*LIT, "+model.optimizer.weight_decy=0.1", "+model.net.chanels=3"],
                                config_dir=lit_conf))
    net, optimizer = refused.value.problems  # in the config's order
    assert net == ("model.net.chanels is not a setting of model.net (lightning_template.SmallCNN) (did you mean "
                   "in_channels?); allowed: in_channels, num_classes")
    assert optimizer.startswith(
        "model.optimizer.weight_decy is not a setting of model.optimizer (torch.optim.Adam) (did you mean "
        "weight_decay?); allowed: amsgrad, betas,")
    with pytest.raises(ConfigError, match=r"model.net.widht is not a setting of model.net \(runner.models.MLP\)"):
        validate(runner.compose(["model=with_net", "+model.net.widht=3"], config_dir=lit_conf))


def test_a_lightning_module_runs_its_steps_on_a_first_batch(lit_conf: Path) -> None:
    """training_step and validation_step run on a batch on the CPU with the trainer view attached: a 1-channel net on
    3-channel images is one line naming the module and both sizes, as is a validation_step that fails."""
    found = check_config(LIT, config_dir=lit_conf)
    assert "training_step and validation_step ran on a first batch (16 samples) on the CPU" in found["report"]
    assert found["gflop_per_sample"] > 0 and "not estimated (its configure_optimizers() chooses" in found["report"]
    with pytest.raises(ConfigError) as refused:
        check_config([*LIT, "model.net.in_channels=1"], config_dir=lit_conf)
    assert len(refused.value.problems) == 1
    line = refused.value.problems[0]
    assert line.startswith("model (lightning_template.LitTemplate): training_step fails on the first batch of "
                           "data.batch_size=16 samples, in net.features.0 (Conv2d): RuntimeError:"), line
    assert "[8, 1, 3, 3]" in line and "[16, 3, 8, 8]" in line and "\n" not in line
    with pytest.raises(ConfigError, match=r"model \(lightning_template.ValidationBreaks\): validation_step fails on "
                                          r"the first val_dataset batch of data.batch_size=16 samples: TypeError"):
        check_config([*LIT, "model._target_=lightning_template.ValidationBreaks"], config_dir=lit_conf)


def test_check_data_sets_up_a_lightning_data_module_with_the_trainer_view(tmp_path: Path) -> None:
    """GlobalBatchData.setup() reads self.trainer.world_size, as a LightningDataModule may: stage=check_data gives it
    the trainer view (it read None and failed), then the module's steps run on its loader's first batch."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "lit.yaml").write_text("_target_: lightning_modules.GlobalBatchData\nglobal_batch_size: 16\n"
                                                "num_samples: 64\nval_samples: 32\nnum_features: 8\nnum_classes: 4\n")
    overrides = ["accelerator=cpu", "data=lit", "model._target_=lightning_modules.LitClassifier",
                 "model.in_features=8", "model.num_classes=4", "trainer.max_steps=4"]
    found = check_config(overrides, config_dir=tmp_path, stage="check_data")
    assert "training_step and validation_step ran on a first batch (16 samples) on the CPU" in found["report"]
