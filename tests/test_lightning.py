"""A Lightning project as it is: a LightningDataModule reads its trainer, a LightningModule's steps, self.log,
configure_optimizers and hooks run as Lightning runs them, with the runner's exactness; what is not run is refused
before launch, one line each. Numbers are compared (1 process x 16 against 2 processes x 8), not exit codes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

import runner

from conftest import REPO, TINY, load_checkpoint

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
    from runner.lightning import TrainerView
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
