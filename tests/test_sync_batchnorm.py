"""strategy.sync_batchnorm: batch norm over the global batch, so 2 processes x batch 8 train as 1 process x 16 does;
without it, one warning says the statistics are each process's own."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hydra.errors import ConfigCompositionException
from torch import nn

from _dist import TESTS_DIR, assert_ok, clean_environ, run_cli, run_ranks
from batchnorm_models import BNNet
from conftest import compose_config
import runner
from runner.config import ConfigError
from runner.strategies import DataParallelStrategy
from runner.strategies.sync_batchnorm import SyncBatchNorm, convert, warn_per_process

# 20 SGD steps of a BatchNorm MLP; a checkpoint at step 10 to resume from.
BN_RUN = ["accelerator=cpu", "data=synthetic", "model._target_=batchnorm_models.BNNet", "optimizer=sgd",
          "trainer.max_steps=20", "trainer.max_epochs=-1", "trainer.ckpt_every_n_steps=10", "data.num_samples=256",
          "data.val_samples=64", "data.num_features=8", "model.hidden=16", "trainer.seed=3"]
ONE_X16 = ["strategy=single", "trainer.devices=1", "data.batch_size=16"]
DDP_2X8 = ["strategy=ddp", "trainer.devices=2", "data.batch_size=8"]
SYNC = "strategy.sync_batchnorm=true"
WARNING = "compute their statistics per process"
RUNNER_DIR = Path(runner.__file__).resolve().parent


def _run(run_dir: Path, *args: str) -> dict:
    """A run's metrics; what its processes printed is kept beside its folder (`<name>.console`), every Python
    warning shown once per place (PYTHONWARNINGS=default shows DeprecationWarning too)."""
    # Workers import the model from tests/ (PYTHONPATH).
    result = run_cli([*BN_RUN, *args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent,
                     env=clean_environ(PYTHONPATH=str(TESTS_DIR), PYTHONWARNINGS="default"))
    assert_ok(result)
    run_dir.with_name(f"{run_dir.name}.console").write_text(result.stdout + result.stderr)
    return json.loads((run_dir / "metrics.json").read_text())


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["model"]


def _assert_same_weights(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(found[name], tensor, atol=1e-5, rtol=0, msg=name)


@pytest.fixture(scope="session")  # built once per test process, wherever its tests land in it
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """1 process x 16, and 2 DDP processes x 8 with and without sync_batchnorm: the same global batches."""
    root = tmp_path_factory.mktemp("sync_batchnorm")
    folders = {"one": (ONE_X16,), "sync": (DDP_2X8, [SYNC]), "plain": (DDP_2X8,)}
    for name, parts in folders.items():
        _run(root / name, *[arg for part in parts for arg in part])
    return {name: root / name for name in folders}


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.slow
@pytest.mark.xdist_group("sync_batchnorm")
def test_two_processes_with_sync_batchnorm_train_as_one_with_twice_the_batch(runs: dict[str, Path]) -> None:
    one, sync = _metrics(runs["one"]), _metrics(runs["sync"])
    assert one["step"] == sync["step"] == 20
    assert sync["val/loss"] == pytest.approx(one["val/loss"], abs=1e-5)
    _assert_same_weights(_weights(runs["sync"]), _weights(runs["one"]))  # running_mean/var included
    log = (runs["sync"] / "runner.log").read_text()
    assert "strategy.sync_batchnorm=true: 2 batch-norm layer(s) (BatchNorm1d x2)" in log and WARNING not in log


@pytest.mark.slow
@pytest.mark.xdist_group("sync_batchnorm")
def test_sync_batchnorm_on_two_processes_warns_nothing_from_the_runners_code(runs: dict[str, Path]) -> None:
    """The layer's collectives and its count raised a FutureWarning and a UserWarning in every process."""
    console = runs["sync"].with_name("sync.console").read_text()
    assert from_runner_files(console) == []
    assert "[WARNING]" not in console


def from_runner_files(console: str) -> list[str]:
    """The lines of `console` that show a Python warning raised at a line of the runner's own code."""
    return re.findall(rf"^{re.escape(str(RUNNER_DIR))}/\S+:\d+: \w+: .*$", console, flags=re.MULTILINE)


@pytest.mark.slow
@pytest.mark.xdist_group("sync_batchnorm")
def test_without_it_the_numbers_differ_and_one_warning_says_why(runs: dict[str, Path]) -> None:
    assert abs(_metrics(runs["plain"])["val/loss"] - _metrics(runs["one"])["val/loss"]) > 1e-3
    said = [line for line in (runs["plain"] / "runner.log").read_text().splitlines() if WARNING in line]
    assert len(said) == 1, said
    assert "[WARNING]" in said[0] and "2 batch-norm layer(s)" in said[0] and "number of processes (2)" in said[0]
    assert "strategy.sync_batchnorm=true" in said[0]
    assert WARNING not in (runs["plain"] / "rank_1.log").read_text()  # rank 0 says it, once
    assert WARNING not in (runs["one"] / "runner.log").read_text()  # one process: nothing depends on it


@pytest.mark.slow
@pytest.mark.xdist_group("sync_batchnorm")
def test_a_sync_checkpoint_resumes_on_one_process(runs: dict[str, Path], tmp_path: Path) -> None:
    resumed = _run(tmp_path / "resumed", *ONE_X16, f"trainer.ckpt_path={runs['sync']}/checkpoints/step-000010.ckpt")
    assert resumed["val/loss"] == pytest.approx(_metrics(runs["one"])["val/loss"], abs=1e-5)
    _assert_same_weights(_weights(tmp_path / "resumed"), _weights(runs["one"]))


@pytest.mark.slow
@pytest.mark.xdist_group("sync_batchnorm")
def test_fsdp_with_sync_batchnorm_resumes_a_one_process_checkpoint(runs: dict[str, Path], tmp_path: Path) -> None:
    """Converted before sharding; a plain BatchNorm checkpoint loads into the converted layers."""
    resumed = _run(tmp_path / "fsdp", "strategy=fsdp", "trainer.devices=2", "data.batch_size=8", SYNC,
                   "strategy.state_dict_type=full", f"trainer.ckpt_path={runs['one']}/checkpoints/step-000010.ckpt")
    assert resumed["val/loss"] == pytest.approx(_metrics(runs["one"])["val/loss"], abs=1e-5)
    _assert_same_weights(_weights(tmp_path / "fsdp"), _weights(runs["one"]))


# -- the layer on two gloo processes -----------------------------------------------------------------

# Layers and input shapes: BatchNorm's rule for momentum, momentum=None (a cumulative average), no affine, 2D maps.
LAYERS = [
    (lambda: nn.BatchNorm1d(3), (8, 3)),
    (lambda: nn.BatchNorm2d(3, momentum=None), (8, 3, 4, 5)),
    (lambda: nn.BatchNorm1d(3, affine=False), (8, 3, 6)),
]
SHARES = (5, 3)  # rows of each rank: the last batch of an epoch may split unevenly


def _layers_over_two_ranks(rank: int) -> None:
    """Rank r holds its share of each batch; its layer must give what BatchNorm gives the whole batch, rows r."""
    dist.init_process_group("gloo")
    rows = slice(0, SHARES[0]) if rank == 0 else slice(SHARES[0], sum(SHARES))
    for make, shape in LAYERS:
        torch.manual_seed(0)
        whole = make()
        if whole.affine:
            nn.init.uniform_(whole.weight, 0.5, 1.5), nn.init.uniform_(whole.bias, -0.5, 0.5)
        mine = SyncBatchNorm.convert(copy.deepcopy(whole))
        for step in range(3):
            x = torch.randn(shape) * (step + 1) + 2.0  # the same on both ranks (same seed)
            upstream = torch.randn(shape)
            x_whole, x_mine = x.clone().requires_grad_(), x[rows].clone().requires_grad_()
            expected = whole(x_whole)
            (expected * upstream).sum().backward()
            out = mine(x_mine)
            (out * upstream[rows]).sum().backward()
            torch.testing.assert_close(out, expected.detach()[rows], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(x_mine.grad, x_whole.grad[rows], atol=1e-5, rtol=1e-5)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(mine, name), getattr(whole, name), atol=1e-6, rtol=1e-6, msg=name)
        if whole.affine:  # each rank's parameter gradients are its rows' share: summed, the whole batch's
            for name in ("weight", "bias"):
                grad = getattr(mine, name).grad.clone()
                dist.all_reduce(grad)
                torch.testing.assert_close(grad, getattr(whole, name).grad, atol=1e-5, rtol=1e-5, msg=name)
        mine.eval(), whole.eval()
        x = torch.randn(shape)
        torch.testing.assert_close(mine(x[rows]), whole(x)[rows])
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.xdist_group("sync_batchnorm")
def test_the_layer_on_two_processes_is_batchnorm_over_the_whole_batch() -> None:
    run_ranks(_layers_over_two_ranks, timeout=90)


# -- one process: conversion, checkpoints, warnings, settings -----------------------------------------

class _OwnNorm(nn.BatchNorm1d):
    """A batch-norm class of a library's own (HF models define some), deep inside the model."""


def test_converted_layers_keep_batchnorms_keys_tensors_and_numbers() -> None:
    torch.manual_seed(0)
    plain = BNNet(in_features=8, hidden=16)
    plain.net[1] = _OwnNorm(16)
    converted = SyncBatchNorm.convert(copy.deepcopy(plain))
    assert [type(m) for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)] == \
        [SyncBatchNorm, SyncBatchNorm]
    assert converted.state_dict().keys() == plain.state_dict().keys()
    layer = BNNet(in_features=8, hidden=16)
    layer_converted = SyncBatchNorm.convert(layer)
    for name, tensor in layer.state_dict().items():  # the same tensors, not copies: the optimizer holds them
        assert layer_converted.state_dict()[name].data_ptr() == tensor.data_ptr(), name
    # Checkpoints load both ways; without a process group the layer is BatchNorm, in training and in eval.
    x = torch.randn(16, 8)
    plain.train(), converted.train()
    torch.testing.assert_close(converted(x), plain(x))
    fresh = BNNet(in_features=8, hidden=16)
    fresh.net[1] = _OwnNorm(16)
    fresh.load_state_dict(converted.state_dict())
    back = SyncBatchNorm.convert(BNNet(in_features=8, hidden=16))
    back.load_state_dict(plain.state_dict())
    for model in (plain, fresh, back):
        model.eval()
    torch.testing.assert_close(fresh(x), plain(x))
    torch.testing.assert_close(back(x), plain(x))
    assert isinstance(SyncBatchNorm.convert(nn.BatchNorm2d(3)), SyncBatchNorm)  # a model that is one layer


def test_one_warning_for_several_processes_none_for_one(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="runner"):
        warn_per_process(nn.Sequential(nn.Linear(2, 2), nn.Sequential(_OwnNorm(2))), world_size=4)
        warn_per_process(BNNet(), world_size=1)
        warn_per_process(nn.Linear(2, 2), world_size=4)
    said = [r for r in caplog.records if r.name == "runner"]
    assert [r.levelname for r in said] == ["WARNING"]
    assert "1 batch-norm layer(s) (_OwnNorm)" in said[0].getMessage()
    assert "number of processes (4)" in said[0].getMessage()


def test_sync_batchnorm_without_batchnorm_says_so_at_info(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="runner"):
        model = convert(nn.Linear(2, 2), torch.device("cpu"), world_size=2, report=True)
    assert isinstance(model, nn.Linear)
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "runner"]
    assert said == [("INFO", "strategy.sync_batchnorm=true: the model has no batch-norm layers; nothing to "
                             "synchronise")]


def test_dp_over_several_devices_warns_that_it_cannot_sync(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from runner.strategies import dp

    monkeypatch.setattr(dp, "DataParallel", lambda module, **_: module)  # no GPUs needed to see the line
    with caplog.at_level("INFO", logger="runner"):
        DataParallelStrategy(parallel_devices=["cuda:0", "cuda:1"]).setup_module(BNNet())
        DataParallelStrategy().setup_module(BNNet())  # one device: nothing depends on the count
    said = [r.getMessage() for r in caplog.records if r.name == "runner"]
    assert len(said) == 1, said
    assert "per device under strategy=dp" in said[0] and "number of devices (2)" in said[0]
    assert "use strategy=ddp strategy.sync_batchnorm=true" in said[0]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sync_batchnorm_is_a_setting_of_ddp_and_fsdp(strategy: str) -> None:
    from runner.build import build_strategy

    built = build_strategy(compose_config(["accelerator=cpu", f"strategy={strategy}", "trainer.devices=2", SYNC]))
    assert built.sync_batchnorm is True
    assert build_strategy(compose_config(["accelerator=cpu", f"strategy={strategy}"])).sync_batchnorm is False


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_other_strategies_refuse_it_as_an_unknown_key(strategy: str) -> None:
    from runner.checks import validate

    with pytest.raises(ConfigCompositionException, match="strategy.sync_batchnorm"):
        compose_config([f"strategy={strategy}", SYNC])
    with pytest.raises(ConfigError, match=f"strategy.sync_batchnorm is not a setting of strategy"):
        validate(compose_config(["accelerator=cpu", f"strategy={strategy}", f"+{SYNC}"]))
