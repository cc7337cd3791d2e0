"""A user's own config tree (`--config-dir`, `hydra.searchpath`, `runner.compose(config_dir=...)`): its options of a
built-in option's name win, with one line saying so; an experiment changing a group's `_target_` over the option's
keys is one line naming them and the fix; Lightning's Trainer, loggers and callbacks (a lightning-hydra-template
tree) are one line each naming the runner's own."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

import runner
from conftest import TINY, clean_environ, run_main
from runner.checks import validate
from runner.config import ConfigError

BASE = [*(o for o in TINY if not o.startswith(("logger.", "model."))), "logger=none"]

ADAMW = "_target_: torch.optim.AdamW\n_partial_: true\nlr: 0.123\n"
MLP = "_target_: runner.models.MLP\nin_features: ${data.num_features}\nhidden: 7\ndepth: 1\n" \
      "num_classes: ${data.num_classes}\n"


def tree(root: Path, files: dict[str, str]) -> Path:
    """`root/my_conf` holding `files` (path inside it -> text)."""
    folder = root / "my_conf"
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def lines(caplog: pytest.LogCaptureFixture, part: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if part in r.getMessage()]


# -- an option of the user's with a built-in option's name -------------------------------------------------------

@pytest.mark.parametrize("how", ["--config-dir", "hydra.searchpath"])
def test_the_users_option_wins_over_the_built_in_one_with_one_line(how: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    conf = tree(tmp_path, {"optimizer/adamw.yaml": ADAMW, "model/mlp.yaml": MLP})
    where = ["--config-dir", str(conf)] if how == "--config-dir" else [f"hydra.searchpath=[file://{conf}]"]
    caplog.set_level(logging.WARNING, logger="runner")
    code, output = run_main([*where, "optimizer=adamw", "--cfg", "job"], monkeypatch, capsys)
    assert code == 0, output
    assert "lr: 0.123" in output and "hidden: 7" in output  # not the built-in 0.003 and 128
    assert lines(caplog, "shadows") == [f"{conf}/optimizer/adamw.yaml shadows the built-in optimizer=adamw",
                                        f"{conf}/model/mlp.yaml shadows the built-in model=mlp"]


def test_the_line_is_on_the_console_of_a_real_command(tmp_path: Path) -> None:
    conf = tree(tmp_path, {"optimizer/adamw.yaml": ADAMW})
    result = subprocess.run([sys.executable, "-m", "runner", "--config-dir", "my_conf", "optimizer=adamw", "--cfg",
                             "job"], cwd=tmp_path, env=clean_environ(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "lr: 0.123" in result.stdout and "shadows" not in result.stdout  # --cfg's YAML stays YAML
    assert result.stderr.count("shadows") == 1, result.stderr
    assert "my_conf/optimizer/adamw.yaml shadows the built-in optimizer=adamw" in result.stderr
    assert conf.is_dir()


def test_the_line_is_in_the_run_folders_log_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    """Said while composing, before the run folder's runner.log is open: written there once it is, once."""
    conf = tree(tmp_path, {"optimizer/adamw.yaml": ADAMW})
    run_dir = tmp_path / "run"
    code, output = run_main(["--config-dir", str(conf), *BASE, "trainer.max_steps=1", f"hydra.run.dir={run_dir}"],
                            monkeypatch, capsys)
    assert code == 0, output
    logged = (run_dir / "runner.log").read_text()
    assert logged.count(f"[WARNING] - {conf}/optimizer/adamw.yaml shadows the built-in optimizer=adamw\n") == 1, logged


def test_compose_takes_the_users_option_the_same_way(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    conf = tree(tmp_path, {"optimizer/adamw.yaml": ADAMW, "config.yaml": "defaults:\n  - optimizer: sgd\n"})
    caplog.set_level(logging.WARNING, logger="runner")
    for _ in range(2):  # each call is a command of its own, with its line
        cfg = runner.compose(["optimizer=adamw"], config_dir=conf)
        assert cfg.optimizer.lr == 0.123
    assert len(lines(caplog, "shadows the built-in optimizer=adamw")) == 2
    # The primary config stays the runner's (as Hydra keeps the app's before --config-dir's), said in one line.
    assert runner.compose([], config_dir=conf).optimizer.lr == 0.123  # the default adamw, not the user's sgd
    assert lines(caplog, f"{conf}/config.yaml is not read: the runner's own config.yaml stays the primary config")


def test_each_job_of_a_sweep_trains_with_the_users_option_said_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    conf = tree(tmp_path, {"optimizer/adamw.yaml": ADAMW})
    caplog.set_level(logging.WARNING, logger="runner")
    code, output = run_main(["-m", "--config-dir", str(conf), *BASE, "trainer.max_steps=1", "data.seed=1,2",
                             f"hydra.sweep.dir={tmp_path / 'sweep'}"], monkeypatch, capsys)
    assert code == 0, output
    for job in ("0", "1"):  # what each job's workers read
        assert "lr: 0.123" in (tmp_path / "sweep" / job / ".hydra" / "resolved.yaml").read_text()
    assert len(lines(caplog, "shadows the built-in optimizer=adamw")) == 1


# -- an experiment that changes a group's _target_ over its option's keys ------------------------------------------

BILINEAR = "# @package _global_\nmodel:\n  _target_: torch.nn.Bilinear\n  in1_features: 8\n  in2_features: 8\n" \
           "  out_features: 4\n"
LEFT = ('model._target_ is torch.nn.Bilinear but model=mlp\'s keys remain (in_features, hidden, depth, num_classes): '
        'add "- override /model: null" to the experiment\'s defaults, or delete them with ~model.in_features '
        "~model.hidden ~model.depth ~model.num_classes")


def test_an_experiments_new_target_over_the_options_keys_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    conf = tree(tmp_path, {"experiment/bilinear.yaml": BILINEAR})
    code, output = run_main(["--config-dir", str(conf), "experiment=bilinear", *BASE,
                             f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
    assert code == 1 and LEFT in output, output
    assert "is not a setting of model" not in output and "1 problem" in output
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_the_option_the_job_chose_is_named_and_a_misspelt_key_keeps_its_line(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch,
                                                                              capsys: pytest.CaptureFixture) -> None:
    conf = tree(tmp_path, {"experiment/bilinear.yaml": BILINEAR, "model/mine.yaml": MLP})
    code, output = run_main(["--config-dir", str(conf), "model=mine", "experiment=bilinear", "+model.biass=false",
                             *BASE, f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
    assert code == 1 and LEFT.replace("model=mlp", "model=mine") in output, output
    assert "model.biass is not a setting of model (torch.nn.Bilinear) (did you mean bias?)" in output
    assert output.count("is not a setting of model") == 1


def test_compose_then_validate_gives_the_same_line(tmp_path: Path) -> None:
    conf = tree(tmp_path, {"experiment/bilinear.yaml": BILINEAR})
    with pytest.raises(ConfigError) as error:
        validate(runner.compose(["experiment=bilinear", *BASE], config_dir=conf))
    assert error.value.problems == [LEFT]


# -- Lightning's Trainer, loggers and callbacks (lightning-hydra-template's files) ------------------------------------

TRAINER = ("_target_: lightning.pytorch.trainer.Trainer\ndefault_root_dir: ${hydra:runtime.output_dir}\nmin_epochs: 1\n"
           "max_epochs: 10\naccelerator: cpu\ndevices: 1\ncheck_val_every_n_epoch: 1\ndeterministic: False\n")
TEMPLATE = [  # file, its text, the choice that reads it, the line
    ("trainer/default.yaml", TRAINER, "trainer=default",
     ("trainer: lightning.pytorch.trainer.Trainer is Lightning's Trainer; the runner's trainer group is plain values "
      "(trainer.max_epochs")),
    ("logger/csv.yaml",
     "csv:\n  _target_: lightning.pytorch.loggers.csv_logs.CSVLogger\n  save_dir: .\n  prefix: ''\n", "logger=csv",
     "logger.csv: lightning.pytorch.loggers.csv_logs.CSVLogger is Lightning's; the runner's is logger=csv"),
    ("logger/tensorboard.yaml", "tensorboard:\n  _target_: lightning.pytorch.loggers.tensorboard.TensorBoardLogger\n",
     "logger=tensorboard", "TensorBoardLogger is Lightning's; the runner's is logger=tensorboard"),
    ("logger/wandb.yaml", "wandb:\n  _target_: lightning.pytorch.loggers.wandb.WandbLogger\n  project: x\n",
     "logger=wandb",
     "logger.wandb: lightning.pytorch.loggers.wandb.WandbLogger is Lightning's; the runner's is logger=wandb"),
    ("logger/mlflow.yaml", "mlflow:\n  _target_: lightning.pytorch.loggers.mlflow.MLFlowLogger\n", "logger=mlflow",
     "MLFlowLogger is Lightning's; the runner's is logger=mlflow"),
    ("callbacks/early_stopping.yaml",
     "early_stopping:\n  _target_: lightning.pytorch.callbacks.EarlyStopping\n  monitor: ???\n  patience: 3\n",
     "callbacks=early_stopping",
     ("callbacks.early_stopping: lightning.pytorch.callbacks.EarlyStopping is Lightning's; the runner's is "
      "callbacks=early_stopping")),
    ("callbacks/model_checkpoint.yaml", "model_checkpoint:\n  _target_: lightning.pytorch.callbacks.ModelCheckpoint\n",
     "callbacks=model_checkpoint", "ModelCheckpoint is Lightning's; the runner's is callbacks=model_checkpoint"),
    ("callbacks/rich_model_summary.yaml",
     "model_summary:\n  _target_: lightning.pytorch.callbacks.RichModelSummary\n  max_depth: -1\n",
     "callbacks=rich_model_summary",
     ("callbacks.model_summary: lightning.pytorch.callbacks.RichModelSummary is Lightning's; the runner's is "
      "callbacks=model_summary")),
    ("callbacks/rich_progress_bar.yaml",
     "rich_progress_bar:\n  _target_: lightning.pytorch.callbacks.RichProgressBar\n", "callbacks=rich_progress_bar",
     "RichProgressBar is Lightning's; the runner's is trainer.progress_bar=true"),
    ("callbacks/lr_monitor.yaml", "lr_monitor:\n  _target_: lightning.pytorch.callbacks.LearningRateMonitor\n",
     "callbacks=lr_monitor", "LearningRateMonitor is Lightning's; the runner needs none"),
]


@pytest.mark.parametrize(("file", "text", "choice", "line"), TEMPLATE, ids=[case[0] for case in TEMPLATE])
def test_a_lightning_class_is_one_line_naming_the_runners_own(file: str, text: str, choice: str, line: str,
                                                              tmp_path: Path) -> None:
    conf = tree(tmp_path, {file: text})
    imported = "lightning" in sys.modules
    with pytest.raises(ConfigError) as error:
        runner.compose([choice], config_dir=conf)
    assert len(error.value.problems) == 1 and line in error.value.problems[0], error.value.problems
    assert error.value.problems[0].startswith(f"{conf / file}: ")
    assert imported or "lightning" not in sys.modules  # told from the string alone


def test_a_template_trainer_stops_the_command_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture) -> None:
    conf = tree(tmp_path, {"trainer/default.yaml": TRAINER})
    code, output = run_main(["--config-dir", str(conf), *BASE, f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch,
                            capsys)
    assert code == 1 and TEMPLATE[0][3] in output, output
    assert "remove or rename" in output and "which shadows the built-in trainer=default" in output
    assert "Traceback" not in output and "TrainerConfig" not in output and not (tmp_path / "run").exists()


@pytest.mark.parametrize("override", ["+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor",
                                      "logger.tensorboard._target_=pytorch_lightning.loggers.TensorBoardLogger"])
def test_a_lightning_class_on_the_command_line_is_one_line(override: str) -> None:
    with pytest.raises(ConfigError) as error:
        runner.compose(["logger=tensorboard", override])
    key = override.lstrip("+").split("._target_")[0]
    assert [p.split(":")[0] for p in error.value.problems] == [key], error.value.problems


# -- an option no group has, named where the user put it ----------------------------------------------------------

@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_an_option_a_users_defaults_list_names_and_no_group_has_is_one_line(sweep: bool, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture) -> None:
    """Hydra's 8 to 13 lines (its search path among them) for an option that is not there, here named in an
    experiment of the user's folder, and, in a sweep, one job's value."""
    conf = tree(tmp_path, {"experiment/mine.yaml": "# @package _global_\ndefaults:\n  - override /model: resnet\n"})
    where = (["optimizer=sgd,lion", f"hydra.sweep.dir={tmp_path / 'sweep'}"] if sweep
             else ["experiment=mine", f"hydra.run.dir={tmp_path / 'run'}"])
    code, output = run_main([*(["-m"] if sweep else []), "--config-dir", str(conf), *BASE, *where], monkeypatch,
                            capsys)
    assert code == 1, output
    expected = ("optimizer=lion is not an option of optimizer: adamw, parts, sgd" if sweep else
                f"model=resnet is not an option of model: mlp (named in the defaults of {conf}/experiment/mine.yaml)")
    assert output.strip().splitlines() == [f"error: {expected}"], output
    assert not (tmp_path / "sweep" / "0").exists() and not (tmp_path / "run" / ".hydra").exists()  # no job ran
