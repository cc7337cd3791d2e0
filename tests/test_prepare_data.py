"""Data modules: prepare_data() once per node while the other processes wait, setup(stage) in every process, and
DataLoaders given by `<split>_dataloader()` read through the runner's own samplers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

import runner
from runner.checks import validate
from runner.config import ConfigError
from runner.data import collate, ready

from conftest import TINY, load_checkpoint

TESTS = Path(__file__).resolve().parent
DDP2 = ("strategy=ddp", "trainer.devices=2", "data.batch_size=8")


@pytest.fixture(autouse=True)
def _workers_import_the_fixtures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


def _cfg(tmp_path: Path, data_class: str, *overrides: str) -> DictConfig:
    """TINY with `data=` the fixtures' `data_class`, its files in `tmp_path/<data_class>`."""
    folder = tmp_path / data_class
    folder.mkdir(parents=True, exist_ok=True)
    (tmp_path / "conf" / "data").mkdir(parents=True, exist_ok=True)
    (tmp_path / "conf" / "data" / "module.yaml").write_text(
        f"_target_: data_info_fixtures.{data_class}\nfolder: {folder}\nbatch_size: 16\nnum_features: 8\n")
    base = [o for o in TINY if not o.startswith("data.")]
    return runner.compose([*base, "data=module", "model.in_features=8", "model.num_classes=2", *overrides],
                          config_dir=str(tmp_path / "conf"))


def _lines(path: Path) -> list[str]:
    return sorted(path.read_text().splitlines()) if path.exists() else []


def test_two_processes_download_once_and_both_set_up(tmp_path: Path) -> None:
    metrics = runner.fit(_cfg(tmp_path, "CountingDataModule", *DDP2), run_dir=tmp_path / "run")
    assert metrics["step"] == 3 and "val/loss" in metrics
    folder = tmp_path / "CountingDataModule"
    assert len(_lines(folder / "downloads")) == 1  # one prepare_data() for the node, not one per process
    # setup("fit") in each process, and setup("test") after training (a data module may make its test set there)
    assert _lines(folder / "setup") == ["0 fit", "0 test", "1 fit", "1 test"]


def test_the_parent_checks_leave_a_data_module_alone(tmp_path: Path) -> None:
    validate(_cfg(tmp_path, "CountingDataModule"))
    folder = tmp_path / "CountingDataModule"
    assert _lines(folder / "downloads") == [] and _lines(folder / "setup") == []


def test_dataloaders_train_what_data_sets_train(tmp_path: Path) -> None:
    """A data module's DataLoaders give their data sets and batch sizes to the runner's samplers: the weights after
    training on 2 processes are those of the same data given as data sets."""
    runner.fit(_cfg(tmp_path, "CountingDataModule", *DDP2), run_dir=tmp_path / "sets")
    metrics = runner.fit(_cfg(tmp_path, "LoaderDataModule", *DDP2), run_dir=tmp_path / "loaders")
    assert len(_lines(tmp_path / "LoaderDataModule" / "downloads")) == 1
    sets, loaders = load_checkpoint(tmp_path / "sets"), load_checkpoint(tmp_path / "loaders")
    for name, value in sets["model"].items():
        torch.testing.assert_close(loaders["model"][name], value, rtol=0, atol=0)
    assert "test/loss" not in metrics  # no test_dataloader(): nothing to test


def test_lightnings_unimplemented_hooks_are_no_split(tmp_path: Path) -> None:
    """LightningDataModule's test_dataloader() raises until overridden: a module without one trains and is not
    tested."""
    metrics = runner.fit(_cfg(tmp_path, "LightningShaped"), run_dir=tmp_path / "run")
    assert metrics["step"] == 3 and "val/loss" in metrics and "tested" not in metrics


def test_a_failed_download_ends_every_process(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="cannot reach the download server"):
        runner.fit(_cfg(tmp_path, "FailingDownload", *DDP2), run_dir=tmp_path / "run")
    assert "data.prepare_data() failed on local rank 0 of a node" in (tmp_path / "run" / "rank_1.log").read_text()


class _Loaders:
    """A data object whose train_dataloader() is `make(dataset)`."""

    def __init__(self, make) -> None:
        self.make, self.dataset = make, torch.utils.data.TensorDataset(torch.zeros(10, 2), torch.zeros(10))

    def train_dataloader(self) -> DataLoader:
        return self.make(self.dataset)


@pytest.mark.parametrize(("make", "refusal"), [
    (lambda ds: DataLoader(ds, batch_size=2, shuffle=True), None),
    (lambda ds: DataLoader(ds, batch_size=2), None),
    (lambda ds: DataLoader(ds, batch_size=None), r"has batch_size=None \(no batching\)"),
    (lambda ds: DataLoader(ds, batch_size=2, sampler=RandomSampler(ds, replacement=True)), None),
    (lambda ds: DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 2, False)),
     r"has a batch sampler of its own \(BatchSampler\): batches it composes cannot be split"),
    (lambda ds: [DataLoader(ds, batch_size=2), DataLoader(ds, batch_size=2)],
     r"gave list, not one DataLoader: the runner reads one loader per stage"),
], ids=["shuffled", "in-order", "unbatched", "with-replacement", "batch-sampler", "several-loaders"])
def test_what_a_loader_keeps_and_what_it_may_not_have(make, refusal) -> None:
    if refusal is None:
        data = ready(_Loaders(make), "fit")
        assert data.train_dataset is data.source.dataset and data.batch_size == 2
        own = make(data.source.dataset).sampler  # a training sampler of its own is the global order
        taken = own if isinstance(own, RandomSampler) and own.replacement else None
        settings = data.split_settings["train"]
        assert type(settings.pop("sampler")) is type(taken)
        assert settings == {"batch_size": 2, "collate_fn": collate, "num_workers": 0, "pin_memory": False}
        return
    with pytest.raises(ConfigError, match=r"data \(_Loaders\): train_dataloader\(\) " + refusal):
        ready(_Loaders(make), "fit")


def test_a_module_that_makes_each_split_in_its_stage_fits_tests_and_tests_again(tmp_path: Path) -> None:
    """setup("fit") makes train and val only, setup("test") the test set only: the fit tests after training, and
    stage=test runs without any train split."""
    fitted = runner.fit(_cfg(tmp_path, "StagedDataModule"), run_dir=tmp_path / "fit")
    assert fitted["tested"] == "last" and "test/loss" in fitted
    last = tmp_path / "fit" / "checkpoints" / "last.ckpt"
    tested = runner.fit(_cfg(tmp_path, "StagedDataModule", "stage=test", f"trainer.ckpt_path={last}"),
                        run_dir=tmp_path / "test")
    assert tested["test/loss"] == pytest.approx(fitted["test/loss"], rel=1e-6)
    assert _lines(tmp_path / "StagedDataModule" / "setup") == ["0 fit", "0 test", "0 test"]
    assert len(_lines(tmp_path / "StagedDataModule" / "downloads")) == 2  # once per run
