"""optimizer._no_decay_ under strategy=fsdp: two parameter groups train what one process trains, and the sharded
checkpoint, keyed by parameter name, resumes each group's state and settings on another process count (and a
folder written before names still resumes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import runner
from conftest import TINY, compose_config
from runner.checkpoint_io import sharded

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp")]

# 256 samples / global batch 32: 8 steps an epoch; the checkpoint of step 6 falls mid-epoch.
BASE = (*[o for o in TINY if not o.startswith(("logger.", "strategy=", "trainer.devices", "data.batch_size"))],
        "logger=none", "optimizer=adamw", "optimizer.weight_decay=0.5",
        "trainer.max_steps=12", "trainer.ckpt_every_n_steps=6")
TWO = ("strategy=fsdp", "trainer.devices=2", "data.batch_size=16")
ONE = ("trainer.devices=1", "data.batch_size=32")


def fit(run_dir: Path, *overrides: str, no_decay: str = "[bias]") -> dict:
    return runner.fit(compose_config([*BASE, f"optimizer._no_decay_={no_decay}", *overrides]), run_dir=run_dir)


def read(path: Path) -> dict:
    return sharded.read(path) if path.is_dir() else torch.load(path, map_location="cpu", weights_only=True)


def assert_same(a: dict, b: dict) -> None:
    """Weights, each group's settings and members, and every parameter's optimizer state."""
    assert a["step"] == b["step"]
    for key, tensor in b["model"].items():
        torch.testing.assert_close(a["model"][key], tensor, rtol=0, atol=1e-6, msg=f"model.{key} differs")
    settings = [({k: v for k, v in g.items() if k != "initial_lr"}) for g in b["optimizer"]["param_groups"]]
    assert [{k: v for k, v in g.items() if k != "initial_lr"} for g in a["optimizer"]["param_groups"]] == settings
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for index, state in b["optimizer"]["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(a["optimizer"]["state"][index][name], value, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FSDP on 2 processes x 16 and one process x 32, both with the biases exempt from a weight decay of 0.5."""
    root = tmp_path_factory.mktemp("no_decay")
    fit(root / "fsdp", *TWO)
    fit(root / "one", "strategy=single", *ONE)
    return root


def test_two_fsdp_processes_train_the_groups_one_process_trains(runs: Path) -> None:
    fsdp, one = read(runs / "fsdp/checkpoints/last.ckpt"), read(runs / "one/checkpoints/last.ckpt")
    assert [(g["weight_decay"], g["params"]) for g in fsdp["optimizer"]["param_groups"]] == [
        (0.5, [0, 1, 2]), (0.0, [3, 4, 5])]
    assert fsdp["optimizer"]["parameter_names"] == ["net.0.weight", "net.2.weight", "net.4.weight", "net.0.bias",
                                                    "net.2.bias", "net.4.bias"]
    assert_same(fsdp, one)
    names = sharded.skeleton(runs / "fsdp/checkpoints/last.ckpt")  # keyed by name on disk, by index when read
    assert sorted(names["optimizer"]["state"]) == [0, 1, 2, 3, 4, 5]


def test_two_processes_resume_on_one_fsdp_process_exactly(runs: Path, tmp_path: Path) -> None:
    fit(tmp_path, "strategy=fsdp", *ONE, f"trainer.ckpt_path={runs / 'fsdp/checkpoints/step-000006.ckpt'}")
    assert_same(read(tmp_path / "checkpoints/last.ckpt"), read(runs / "one/checkpoints/last.ckpt"))


def test_one_process_resumes_on_two_fsdp_processes_exactly(runs: Path, tmp_path: Path) -> None:
    fit(tmp_path, *TWO, f"trainer.ckpt_path={runs / 'one/checkpoints/step-000006.ckpt'}")
    assert_same(read(tmp_path / "checkpoints/last.ckpt"), read(runs / "one/checkpoints/last.ckpt"))


def test_a_folder_written_before_names_still_resumes(tmp_path: Path) -> None:
    """The layout of earlier versions (state under `optimizer_state.<index>`, in the model's order: one group)."""
    common = ("trainer.max_steps=4", "trainer.ckpt_every_n_steps=2")
    fit(tmp_path / "straight", "strategy=single", *ONE, *common, no_decay="[]")
    step2 = read(tmp_path / "straight/checkpoints/step-000002.ckpt")
    old = tmp_path / "old.ckpt"
    tensors = {"model": step2["model"], "optimizer_state": {
        str(index): {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
        for index, entries in step2["optimizer"]["state"].items()}}
    rest = {**step2, "optimizer": {**step2["optimizer"], "state": {index: {} for index in step2["optimizer"]["state"]}}}
    del rest["model"]
    tmp = sharded.temporary_path(old, "test")
    sharded.write(tensors, rest, tmp)
    sharded.publish(tmp, old)
    fit(tmp_path / "resumed", *TWO, *common, f"trainer.ckpt_path={old}", no_decay="[]")
    assert_same(read(tmp_path / "resumed/checkpoints/last.ckpt"), read(tmp_path / "straight/checkpoints/last.ckpt"))


def test_a_grouped_file_that_names_no_parameters_is_refused_under_fsdp(runs: Path, tmp_path: Path) -> None:
    """A file of two groups saved before optimizers recorded their parameters' names: which state is whose cannot
    be told, so fsdp (which must know to cut it) refuses it in one line; the index order suits ddp and single."""
    from runner.checkpoint_io import TorchCheckpointIO

    io = TorchCheckpointIO()
    checkpoint = io.load_checkpoint(runs / "one/checkpoints/step-000006.ckpt")
    del checkpoint["optimizer"]["parameter_names"]
    io.save_checkpoint(checkpoint, tmp_path / "old.ckpt")
    with pytest.raises(Exception, match=(
            rf"cannot load checkpoint {tmp_path / 'old.ckpt'} under strategy=fsdp: cannot tell which parameter each "
            r"optimizer state belongs to: 1 optimizer\(s\), 2 group\(s\) over 6 of the model's 6 parameters.*; resume "
            "it with strategy=ddp or single")):
        fit(tmp_path / "run", "strategy=fsdp", *ONE, f"trainer.ckpt_path={tmp_path / 'old.ckpt'}")
    fit(tmp_path / "single", "strategy=single", *ONE, f"trainer.ckpt_path={tmp_path / 'old.ckpt'}")
    assert_same(read(tmp_path / "single/checkpoints/last.ckpt"), read(runs / "one/checkpoints/last.ckpt"))
