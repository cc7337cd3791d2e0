"""Evaluation under strategy=fsdp when the processes' shares of the data differ: every process runs as many forwards
(FSDP's forward is a collective), the padding forwards count for nothing, and the metrics are one process's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import runner
from _dist import run_ranks
from conftest import TINY, compose_config
from runner.loop.even import even_batches

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp")]

# 65 validation samples: 33 and 32 on 2 processes, 5 and 4 batches of 8. strategy.timeout bounds a hang.
BASE = (*[o for o in TINY if not o.startswith(("logger.", "strategy=", "trainer.devices", "data.batch_size",
                                                "data.val_samples"))],
        "logger=none", "data.val_samples=65", "trainer.max_steps=2", "strategy=fsdp", "strategy.timeout=30")


def test_uneven_validation_shares_finish_with_one_processs_metrics(tmp_path: Path) -> None:
    two = runner.fit(compose_config([*BASE, "trainer.devices=2", "data.batch_size=8"]), run_dir=tmp_path / "two")
    one = runner.fit(compose_config([*BASE, "trainer.devices=1", "data.batch_size=16"]), run_dir=tmp_path / "one")
    assert two["val/loss"] == pytest.approx(one["val/loss"], rel=0, abs=1e-6)
    assert two["val/acc"] == one["val/acc"]
    assert "val/loss 1.348  val/acc 0.3385  (65 samples" in (tmp_path / "two" / "runner.log").read_text()


def forwards_scenario(rank: int) -> dict:
    """Shares of 2 and 0 batches (counted), and streams of 3 and 1, 1 and 0 (unknown lengths): each batch a
    sharded forward, as evaluation runs them."""
    from runner.environments import LocalEnvironment
    from runner.models import MLP
    from runner.strategies import FSDPStrategy

    strategy = FSDPStrategy(parallel_devices=[torch.device("cpu")] * 2, cluster_environment=LocalEnvironment(),
                            timeout=20)
    strategy.setup_environment()
    torch.manual_seed(0)
    model = strategy.setup_module(MLP(in_features=4, hidden=8, depth=2, num_classes=2))

    def run(batches: list, count: float) -> list:
        real = []
        with torch.no_grad():
            for batch, is_real in even_batches(strategy, iter(batches), count):
                model(batch)  # all-gathers: a process that stopped early would leave the other waiting
                if is_real:
                    real.append(int(batch[0, 0]))
        return real

    def batches(n: int) -> list:
        return [torch.full((3, 4), float(10 * rank + i)) for i in range(n)]

    return {"counted": run(batches((2, 0)[rank]), (2, 0)[rank]),
            "stream": run(batches((3, 1)[rank]), float("inf")),
            "stream_empty": run(batches((1, 0)[rank]), float("inf"))}


def test_every_process_runs_as_many_forwards_and_only_its_own_batches_count() -> None:
    zero, one = run_ranks(forwards_scenario, world_size=2, timeout=90)
    assert zero == {"counted": [0, 1], "stream": [0, 1, 2], "stream_empty": [0]}
    assert one == {"counted": [], "stream": [10], "stream_empty": []}


def test_uneven_predict_shares_finish_with_one_processs_predictions(tmp_path: Path) -> None:
    """stage=predict over 65 samples on 2 FSDP processes (5 batches and 4): the padding forward's rows are dropped,
    and predictions.pt is 1 process's, row for row (it waited out strategy.timeout)."""
    runner.fit(compose_config([*BASE, "trainer.devices=1", "data.batch_size=16"]), run_dir=tmp_path / "fit")
    last = f"trainer.ckpt_path={tmp_path / 'fit' / 'checkpoints' / 'last.ckpt'}"
    predict = (*BASE, "stage=predict", last, "data.test_samples=65")
    runner.fit(compose_config([*predict, "trainer.devices=2", "data.batch_size=8"]), run_dir=tmp_path / "two")
    runner.fit(compose_config([*predict, "trainer.devices=1", "data.batch_size=16"]), run_dir=tmp_path / "one")
    two, one = (torch.load(tmp_path / name / "predictions.pt", weights_only=True)["predictions"]
                for name in ("two", "one"))
    assert two.shape == (65, 4)
    torch.testing.assert_close(two, one, rtol=0, atol=1e-6)
