"""Composing from Python and from other Hydra code: a user's config folder adds to the built-in groups, and
`runner.compose`/`runner.fit` work inside another Hydra app or after `hydra.initialize()`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import runner
from conftest import TINY, clean_environ
from runner.config import ConfigError

# An option of the user's own, beside a name the built-in groups already have.
TINY_MODEL = "_target_: runner.models.MLP\nin_features: ${data.num_features}\nhidden: 4\ndepth: 1\n" \
             "num_classes: ${data.num_classes}\n"


@pytest.fixture
def user_conf(tmp_path: Path) -> Path:
    folder = tmp_path / "my_conf"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "tiny.yaml").write_text(TINY_MODEL)
    (folder / "model" / "mlp.yaml").write_text(TINY_MODEL.replace("hidden: 4", "hidden: 999"))
    (folder / "config.yaml").write_text("defaults:\n  - model: tiny\n")
    return folder


def test_config_dir_adds_options_and_its_own_option_of_a_built_in_name_wins(user_conf: Path) -> None:
    cfg = runner.compose(["model=tiny", "strategy=ddp", "logger=tensorboard"], config_dir=user_conf)
    assert cfg.model.hidden == 4 and cfg.strategy._target_ == "runner.strategies.DDPStrategy"
    # The built-in primary config stays (its default is model=mlp, not the user's config.yaml's model=tiny), and
    # the user's model/mlp.yaml is the model=mlp it chooses (tests/test_user_config_tree.py has the line saying so).
    default = runner.compose([], config_dir=user_conf)
    assert default.model.hidden == 999 and default.trainer.max_epochs is None


def test_a_missing_config_dir_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config_dir=.*is not a folder"):
        runner.compose([], config_dir=tmp_path / "nope")


@pytest.mark.parametrize("how", ["--config-dir", "hydra.searchpath"])
def test_the_command_line_adds_a_users_folder_the_same_way(user_conf: Path, tmp_path: Path, how: str) -> None:
    where = ["--config-dir", str(user_conf)] if how == "--config-dir" else [f"hydra.searchpath=[file://{user_conf}]"]
    result = subprocess.run([sys.executable, "-m", "runner", *where, "model=tiny", "strategy=ddp", "--cfg", "job"],
                            cwd=tmp_path, env=clean_environ(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "hidden: 4" in result.stdout and "runner.strategies.DDPStrategy" in result.stdout


def test_compose_after_hydra_initialize_leaves_the_outer_hydra_working(tmp_path: Path) -> None:
    (tmp_path / "app.yaml").write_text("greeting: hello\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = runner.compose(["trainer.max_steps=2"])
        assert cfg.trainer.max_steps == 2
        assert compose(config_name="app").greeting == "hello"  # the caller's Hydra is back
    assert not GlobalHydra.instance().is_initialized()


APP = """
import json, sys
import hydra
from hydra.core.hydra_config import HydraConfig
import runner

@hydra.main(version_base=None, config_path=".", config_name="app")
def main(app_cfg):
    cfg = runner.compose(app_cfg.overrides)
    metrics = runner.fit(cfg, run_dir=app_cfg.run_dir)
    print(json.dumps({"step": metrics["step"], "job": HydraConfig.get().job.name, "lr": app_cfg.lr}))

main()
"""


def test_compose_and_fit_inside_another_hydra_app(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(textwrap.dedent(APP))
    overrides = json.dumps([*TINY, "trainer.max_steps=2"])
    (tmp_path / "app.yaml").write_text(f"lr: 0.5\nrun_dir: {tmp_path / 'run'}\noverrides: {overrides}\n")
    result = subprocess.run([sys.executable, "app.py", "lr=0.25", f"hydra.run.dir={tmp_path / 'app_run'}"],
                            cwd=tmp_path, env=clean_environ(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"step": 2, "job": "app", "lr": 0.25}
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["step"] == 2
