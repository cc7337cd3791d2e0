"""The data object is built once per process (the checks before launch build no copy of their own), a data module
prepares once per node and sets up once per stage it serves, and processes that built different data are refused
with one line before training."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig
from torch.utils.data import IterableDataset

import runner

from _dist import clean_environ, run_cli
from conftest import REPO
from setup_counting_data import read_calls

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("data_setup")]

TESTS = Path(__file__).resolve().parent
SHORT = ("accelerator=cpu", "model.in_features=8", "model.num_classes=2", "model.hidden=16", "trainer.max_steps=3",
         "trainer.max_epochs=-1", "logger=none")
DDP2 = ("strategy=ddp", "trainer.devices=2")


def _config_dir(tmp_path: Path, data_class: str) -> Path:
    """A config folder whose `data=counting` is the fixtures' `data_class`, recording its calls in tmp_path/calls."""
    (tmp_path / "calls").mkdir(exist_ok=True)
    (tmp_path / "conf" / "data").mkdir(parents=True, exist_ok=True)
    (tmp_path / "conf" / "data" / "counting.yaml").write_text(
        f"_target_: setup_counting_data.{data_class}\nfolder: {tmp_path / 'calls'}\nbatch_size: 16\nnum_features: 8\n"
        "num_samples: 256\n")
    return tmp_path / "conf"


def _cfg(tmp_path: Path, data_class: str) -> DictConfig:
    return runner.compose(["data=counting", *SHORT], config_dir=str(_config_dir(tmp_path, data_class)))


def _cli(tmp_path: Path, data_class: str, *overrides: str):
    """`python -m runner` with 2 DDP processes on CPU and `data=counting`."""
    conf = _config_dir(tmp_path, data_class)
    env = clean_environ(PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]))
    return run_cli(["--config-dir", str(conf), "data=counting", *SHORT, *DDP2, *overrides,
                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env)


def _counts(tmp_path: Path) -> Counter:
    """{(call, rank[, stage]): times}, and that each rank made its calls in one process."""
    calls = read_calls(tmp_path / "calls")
    for rank in {call[2] for call in calls}:
        assert len({call[1] for call in calls if call[2] == rank}) == 1, calls  # not the launcher's, nor a second
    return Counter((what, *rest) for what, _pid, *rest in calls)


def test_one_process_builds_its_data_once(tmp_path: Path) -> None:
    """The checks before training build the data the worker of the same process then trains on."""
    metrics = runner.fit(_cfg(tmp_path, "EagerData"), run_dir=tmp_path / "run")
    assert metrics["step"] == 3
    assert read_calls(tmp_path / "calls") == [("init", str(os.getpid()), "0")]


def test_data_drawing_from_the_global_generators_is_built_again_after_seeding(tmp_path: Path) -> None:
    """Built by the checks under a forked generator, it would not be what trainer.seed makes: the worker builds its
    own, as runs always did, and says why."""
    runner.fit(_cfg(tmp_path, "DrawingData"), run_dir=tmp_path / "run")
    assert [call[0] for call in read_calls(tmp_path / "calls")] == ["init", "init"]
    assert "data: built again for training: its construction draws from the global random number generators" in (
        tmp_path / "run" / "runner.log").read_text()


def test_a_data_module_is_built_once_and_set_up_once_per_stage(tmp_path: Path) -> None:
    runner.fit(_cfg(tmp_path, "CountingModule"), run_dir=tmp_path / "run")
    assert _counts(tmp_path) == {("init", "0"): 1, ("prepare_data", "0"): 1, ("setup", "0", "fit"): 1,
                                 ("setup", "0", "test"): 1}


@pytest.mark.parametrize("data_class", ["EagerData", "CountingModule"])
def test_two_processes_build_their_data_once_each_and_the_launcher_none(tmp_path: Path, data_class: str) -> None:
    result = _cli(tmp_path, data_class)
    assert result.returncode == 0, result.stderr
    counts = _counts(tmp_path)
    assert {key: n for key, n in counts.items() if key[0] == "init"} == {("init", "0"): 1, ("init", "1"): 1}
    if data_class == "CountingModule":  # prepare_data once for the node; fit, then test, in each process
        assert counts == {("init", "0"): 1, ("init", "1"): 1, ("prepare_data", "0"): 1, ("setup", "0", "fit"): 1,
                          ("setup", "1", "fit"): 1, ("setup", "0", "test"): 1, ("setup", "1", "test"): 1}


@pytest.mark.parametrize(("overrides", "line"), [
    (("+data.short_rank=1", "+data.short_by=56"),
     "data: rank 1 has 200 train samples, rank 0 has 256; every process must build the same data (setup(stage) must "
     "not depend on the rank)"),
    (("+data.short_rank=1", "+data.rank_batch_size=8"),
     "data: rank 1 has batch_size 8, rank 0 has 16; every process must build the same data (setup(stage) must not "
     "depend on the rank)"),
], ids=["fewer-samples", "another-batch-size"])
def test_ranks_that_set_up_different_data_are_refused_in_one_line(tmp_path: Path, overrides: tuple,
                                                                  line: str) -> None:
    start = time.monotonic()
    result = _cli(tmp_path, "CountingModule", "trainer.max_steps=100000", *overrides)
    assert time.monotonic() - start < 60  # refused after setup, not a collective's timeout later
    assert result.returncode == 1, result.stderr
    assert line in result.stderr.splitlines() or f"  - {line}" in result.stderr.splitlines(), result.stderr
    assert "Traceback" not in result.stderr and "SIGABRT" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


class _Data:
    def __init__(self, train, batch_size: int = 4, val=None) -> None:
        self.train_dataset, self.val_dataset, self.batch_size = train, val, batch_size


def test_a_stream_is_compared_by_what_is_known_of_it() -> None:
    """A stream has no length: processes agree when each has one, and a stream against a sized set is refused."""
    from runner.data.modules import data_facts, facts_difference

    sized, stream = data_facts(_Data(torch.zeros(256))), data_facts(_Data(_Stream()))
    assert facts_difference([stream, data_facts(_Data(_Stream()))], "setup(stage)") is None
    assert facts_difference([sized, stream], "its constructor") == (
        "data: rank 1 has a train set without a length, rank 0 has 256 train samples; every process must build the "
        "same data (its constructor must not depend on the rank)")
    assert facts_difference([sized, data_facts(_Data(torch.zeros(256), val=torch.zeros(8)))], "setup(stage)") == (
        "data: rank 1 has 8 val samples, rank 0 has no val set; every process must build the same data (setup(stage) "
        "must not depend on the rank)")
