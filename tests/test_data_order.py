"""The global order of training samples: each process's share of a drawn order, a stream's own position, what a
checkpoint's position means, and what the order costs. That every kind of data trains the same global batches on any
number of processes and resumes exactly is the exactness oracle's (tests/test_exactness.py)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
import torch

import runner
from runner.config import ConfigError
from runner.data import TrainSampler, ready
from runner.data.order import Drawn, Shuffled

from conftest import TINY, compose_config, load_checkpoint

TESTS = Path(__file__).resolve().parent
STREAM = ("data._target_=stream_data.StreamData", "trainer.limit_val_batches=8")
WEIGHTED = ("data._target_=stream_data.WeightedData",)


@pytest.fixture(autouse=True)
def _workers_import_the_fixtures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    monkeypatch.syspath_prepend(str(TESTS))


def _fit(tmp_path: Path, name: str, *overrides: str) -> dict:
    cfg = compose_config([*TINY, *overrides])
    return runner.fit(cfg, run_dir=tmp_path / name)


def _same_weights(a: Path, b: Path) -> None:
    first, second = load_checkpoint(a)["model"], load_checkpoint(b)["model"]
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_stream_with_a_position_of_its_own_resumes_from_it(tmp_path: Path) -> None:
    positioned = ("data._target_=stream_data.PositionedData", "trainer.limit_val_batches=8")
    _fit(tmp_path, "straight", *positioned, "trainer.max_steps=8")
    _fit(tmp_path, "first", *positioned, "trainer.max_steps=5")
    assert load_checkpoint(tmp_path / "first")["data_state"] == {"stream": {"position": 80}}
    _fit(tmp_path, "resumed", *positioned, "trainer.max_steps=8",
         f"trainer.ckpt_path={tmp_path / 'first' / 'checkpoints' / 'last.ckpt'}")
    _same_weights(tmp_path / "straight", tmp_path / "resumed")
    log = (tmp_path / "resumed" / "runner.log").read_text()
    assert "from its own position (its state_dict), 80 samples into epoch 0" in log and "read past" not in log


def test_each_process_takes_its_share_of_every_global_batch_of_a_drawn_order() -> None:
    weights = torch.linspace(0.1, 1.0, 100)
    sampler = torch.utils.data.WeightedRandomSampler(weights, num_samples=96, replacement=True)
    one = list(TrainSampler(Drawn(sampler, seed=3, what="data"), batch_size=8, num_replicas=1, rank=0))
    ranks = [list(TrainSampler(Drawn(sampler, seed=3, what="data"), batch_size=4, num_replicas=2, rank=r))
             for r in (0, 1)]
    for batch in range(12):  # global batch k: the same samples, whichever process takes them
        assert sorted(ranks[0][batch * 4:(batch + 1) * 4] + ranks[1][batch * 4:(batch + 1) * 4]) == sorted(
            one[batch * 8:(batch + 1) * 8])
    assert one != list(TrainSampler(Drawn(sampler, seed=4, what="data"), batch_size=8, num_replicas=1, rank=0))


def test_a_sampler_that_no_seed_reaches_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train_dataloader\(\): its sampler UnseededSampler gives another order "
                                          r"each time it is drawn with the same seeds"):
        _fit(tmp_path, "run", *WEIGHTED, "+data.own_random=true")


def test_a_stream_of_unknown_length_needs_max_steps(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer.max_steps=-1: the training stream does not say its length"):
        _fit(tmp_path, "run", *STREAM, "trainer.max_steps=-1", "trainer.max_epochs=1")


def test_a_loader_over_a_stream_trains_what_the_stream_given_as_such_trains(tmp_path: Path) -> None:
    _fit(tmp_path, "stream", *STREAM, "trainer.max_steps=4")
    _fit(tmp_path, "loader", "data._target_=stream_data.StreamLoaders", "trainer.max_steps=4")
    _same_weights(tmp_path / "stream", tmp_path / "loader")


def test_a_loaders_distributed_sampler_leaves_the_split_to_the_runner() -> None:
    """A loader built for one process of several (DistributedSampler, as hand-written DDP scripts make it) holds that
    process's share only: the runner takes the data set and splits it itself."""
    dataset = torch.utils.data.TensorDataset(torch.zeros(10, 2), torch.zeros(10))

    class Module:
        def train_dataloader(self) -> torch.utils.data.DataLoader:
            sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=1)
            return torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler)

    data = ready(Module(), "fit")
    assert data.train_dataset is dataset and data.split_settings["train"]["sampler"] is None


def test_a_stream_that_says_its_length_has_epochs(tmp_path: Path) -> None:
    """256 samples in batches of 16: 16 steps an epoch, validated at each epoch's end."""
    result = _fit(tmp_path, "run", *STREAM, "+data.sized=true", "trainer.max_steps=-1", "trainer.max_epochs=2")
    assert (result["step"], result["epoch"]) == (32, 2)


def test_resuming_on_other_data_is_refused_mid_epoch_or_restarts_it_on_request(tmp_path: Path) -> None:
    _fit(tmp_path, "first", "trainer.max_steps=5")
    last = f"trainer.ckpt_path={tmp_path / 'first' / 'checkpoints' / 'last.ckpt'}"
    with pytest.raises(ConfigError, match=r"stopped 80 samples into epoch 0 of a shuffled order of 256 samples, "
                                          r"but this run reads a shuffled order of 128 samples.*"
                                          r"trainer.data_resume=restart"):
        _fit(tmp_path, "changed", "trainer.max_steps=8", "data.num_samples=128", last)
    restarted = _fit(tmp_path, "restarted", "trainer.max_steps=8", "data.num_samples=128", last,
                     "trainer.data_resume=restart")
    assert restarted["step"] == 8
    assert "trainer.data_resume=restart: epoch 0 of the data starts again" in (
        tmp_path / "restarted" / "runner.log").read_text()


def test_the_order_of_a_big_set_costs_a_few_bytes_a_sample() -> None:
    """10^7 samples: the order is a tensor of int32, and the first batch does not build the epoch in Python."""
    assert Shuffled(10**7, seed=0).draw(0).dtype == torch.int32
    sampler = TrainSampler(Shuffled(10**7, seed=0), batch_size=64, num_replicas=2, rank=1)
    tracemalloc.start()
    first = [index for _, index in zip(range(64), sampler)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(set(first)) == 64 and peak < 20 * 2**20  # a Python list of the epoch: ~400 MB
