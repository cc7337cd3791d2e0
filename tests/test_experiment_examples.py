"""Tests for the char LM and digits example experiments: their data and model objects, and their presets."""

import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.nn import functional as F
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]

from runner.examples.charlm import CharTransformer, StdlibText  # noqa: E402
from runner.examples.digits import DigitsCNN, DigitsData  # noqa: E402
from runner.data import Batch, collate  # noqa: E402

SMALL_BYTES = 200_000


@pytest.fixture(scope="module")
def text() -> StdlibText:
    return StdlibText(block_size=64, batch_size=8, max_bytes=SMALL_BYTES, val_fraction=0.1, seed=0)


@pytest.fixture(scope="module")
def digits() -> DigitsData:
    pytest.importorskip("sklearn")
    return DigitsData(seed=0)


def tiny_lm(**kwargs) -> CharTransformer:
    torch.manual_seed(0)
    args = {"block_size": 32, "d_model": 32, "n_layers": 2, "n_heads": 4} | kwargs
    return CharTransformer(**args).eval()


# --- StdlibText -------------------------------------------------------------------------------


def test_text_windows_are_long_and_targets_are_inputs_shifted(text):
    assert (text.vocab_size, text.block_size, text.batch_size) == (256, 64, 8)
    for dataset in (text.train_dataset, text.val_dataset):
        assert len(dataset) == (len(dataset.data) - 1) // 64
        for index in (0, len(dataset) - 1):
            inputs, targets = dataset[index]
            assert inputs.shape == targets.shape == (64,)
            assert inputs.dtype == targets.dtype == torch.long
            assert torch.equal(inputs[1:], targets[:-1])
            start = index * 64
            assert torch.equal(targets, dataset.data[start + 1 : start + 65].long())
            assert 0 <= int(inputs.min()) and int(inputs.max()) < 256


def test_text_getitems_is_one_batch_equal_to_getitem(text):
    dataset = text.train_dataset
    indices = [3, 0, len(dataset) - 1, 3]
    batch = dataset.__getitems__(indices)
    assert isinstance(batch, Batch)
    inputs, targets = batch
    assert inputs.shape == targets.shape == (4, 64) and inputs.is_contiguous() and targets.is_contiguous()
    for row, index in enumerate(indices):
        ref_inputs, ref_targets = dataset[index]
        assert torch.equal(inputs[row], ref_inputs) and torch.equal(targets[row], ref_targets)
    loaded_inputs, loaded_targets = next(iter(DataLoader(dataset, batch_size=8, collate_fn=collate)))
    assert loaded_inputs.shape == (8, 64) and torch.equal(loaded_targets[0], dataset[0][1])


def test_text_files_split_whole_and_disjoint(text):
    assert text.train_files and text.val_files
    assert not set(text.train_files) & set(text.val_files)
    for name in text.train_files + text.val_files:
        parts = name.split("/")
        assert name.endswith(".py")
        assert not {"site-packages", "test", "tests"} & set(parts[:-1])
    assert text.num_train_tokens == len(text.train_dataset.data)
    assert text.num_val_tokens == len(text.val_dataset.data)
    # The standard library holds megabytes of source, so both byte budgets fill exactly.
    assert text.num_val_tokens == round(0.1 * SMALL_BYTES)
    assert text.num_train_tokens + text.num_val_tokens == SMALL_BYTES


def test_text_stream_is_the_files_bytes_in_order(text):
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    first = (root / text.val_files[0]).read_bytes()
    size = min(len(first), text.num_val_tokens)
    assert bytes(text.val_dataset.data[:size].tolist()) == first[:size]


def test_text_same_seed_same_split_other_seed_other_split_and_global_rng_untouched(text):
    state = torch.random.get_rng_state()
    again = StdlibText(block_size=64, batch_size=8, max_bytes=SMALL_BYTES, val_fraction=0.1, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert again.train_files == text.train_files and again.val_files == text.val_files
    assert torch.equal(again.train_dataset.data, text.train_dataset.data)
    other = StdlibText(block_size=64, batch_size=8, max_bytes=SMALL_BYTES, val_fraction=0.1, seed=1)
    assert other.val_files != text.val_files


def test_text_without_validation_has_an_empty_val_set():
    data = StdlibText(block_size=16, max_bytes=10_000, val_fraction=0.0)
    assert len(data.val_dataset) == 0 and data.val_files == []
    assert len(data.train_dataset) == (10_000 - 1) // 16


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"block_size": 0}, "block_size=0"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"max_bytes": 100}, "max_bytes=100"),
        ({"val_fraction": 1.0}, "val_fraction=1.0"),
        ({"val_fraction": -0.1}, "val_fraction=-0.1"),
        ({"num_workers": -1}, "num_workers=-1"),
    ],
)
def test_bad_text_args_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        StdlibText(**kwargs)


# --- CharTransformer --------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 17, 32])
def test_lm_gives_logits_for_any_length_up_to_block_size(length):
    model = tiny_lm()
    logits = model(torch.randint(0, 256, (3, length)))
    assert logits.shape == (3, length, 256) and logits.dtype == torch.float32


def test_lm_refuses_too_long_or_flat_input():
    model = tiny_lm()
    with pytest.raises(ValueError, match="block_size \\(32\\)"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="must be \\(batch, T\\)"):
        model(torch.zeros(32, dtype=torch.long))


def test_lm_is_causal():
    model = tiny_lm()
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(after[:, :20], before[:, :20], rtol=0, atol=1e-5)
    assert not torch.allclose(after[:, 20:], before[:, 20:])


def test_lm_right_padding_leaves_earlier_logits_alone():
    model = tiny_lm()
    idx = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([idx, torch.zeros(2, 12, dtype=torch.long)], dim=1)
    with torch.no_grad():
        short, long = model(idx), model(padded)
    torch.testing.assert_close(long[:, :20], short, rtol=0, atol=1e-5)


def test_lm_rows_do_not_depend_on_the_rest_of_the_batch():
    model = tiny_lm()
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    idx = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole, alone = model(idx), torch.cat([model(idx[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(whole, alone, rtol=0, atol=1e-5)


def test_lm_tied_head_shares_the_embedding():
    tied, untied = tiny_lm(tie_weights=True), tiny_lm()
    assert tied.head.weight is tied.tok_emb.weight
    assert sum(p.numel() for p in tied.parameters()) == sum(p.numel() for p in untied.parameters()) - 256 * 32


def test_lm_learns_the_byte_statistics(text):
    model = tiny_lm(block_size=64).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dataset = text.train_dataset
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        inputs, targets = dataset.__getitems__(torch.randint(len(dataset), (16,), generator=generator).tolist())
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # ln(256) = 5.55 nats is a uniform guess; source text's byte frequencies alone give about 3.
    assert loss.item() < 3.6


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"vocab_size": 1}, "vocab_size=1"),
        ({"block_size": 0}, "block_size=0"),
        ({"n_layers": 0}, "n_layers=0"),
        ({"n_heads": 0}, "n_heads=0"),
        ({"d_model": 30, "n_heads": 4}, "d_model=30"),
        ({"dropout": 1.0}, "dropout=1.0"),
    ],
)
def test_bad_lm_args_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CharTransformer(**kwargs)


# --- DigitsData -------------------------------------------------------------------------------


def test_digits_shapes_dtypes_and_range(digits):
    assert (digits.num_classes, digits.batch_size, digits.num_workers, digits.pin_memory) == (10, 64, 0, False)
    assert len(digits.train_dataset) + len(digits.val_dataset) == 1797
    for dataset in (digits.train_dataset, digits.val_dataset):
        images, labels = dataset.inputs, dataset.targets
        assert images.shape == (len(dataset), 1, 8, 8) and images.dtype == torch.float32
        assert labels.dtype == torch.long
        assert float(images.min()) == 0.0 and float(images.max()) == 1.0
        assert torch.equal(labels.unique(), torch.arange(10))


def test_digits_split_is_stratified_disjoint_and_complete(digits):
    train, val = digits.train_indices, digits.val_indices
    assert not set(train.tolist()) & set(val.tolist())
    assert sorted(train.tolist() + val.tolist()) == list(range(1797))
    train_counts = torch.bincount(digits.train_dataset.targets, minlength=10)
    val_counts = torch.bincount(digits.val_dataset.targets, minlength=10)
    share = val_counts / (train_counts + val_counts)
    assert (share - 0.2).abs().max() < 0.01


def test_digits_split_is_deterministic_per_seed(digits):
    state = torch.random.get_rng_state()
    again, other = DigitsData(seed=0), DigitsData(seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(again.val_indices, digits.val_indices)
    assert torch.equal(again.train_dataset.inputs, digits.train_dataset.inputs)
    assert not torch.equal(other.val_indices, digits.val_indices)


def test_digits_batches_come_whole(digits):
    inputs, targets = next(iter(DataLoader(digits.train_dataset, batch_size=64, collate_fn=collate)))
    assert inputs.shape == (64, 1, 8, 8) and targets.shape == (64,)
    assert torch.equal(targets, digits.train_dataset.targets[:64])


def test_digits_missing_sklearn_says_how_to_install(monkeypatch):
    # None in sys.modules makes `import sklearn.datasets` raise ImportError, as if it were not installed.
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ImportError, match="pip install scikit-learn"):
        DigitsData()


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"batch_size": 0}, "batch_size=0"),
        ({"val_fraction": 0.0}, "val_fraction=0.0"),
        ({"val_fraction": 1.0}, "val_fraction=1.0"),
        ({"val_fraction": 0.001}, "val_fraction=0.001"),
        ({"num_workers": -1}, "num_workers=-1"),
    ],
)
def test_bad_digits_args_name_the_argument(kwargs, name):
    pytest.importorskip("sklearn")
    with pytest.raises(ValueError, match=name):
        DigitsData(**kwargs)


# --- DigitsCNN --------------------------------------------------------------------------------


def test_digits_cnn_gives_logits_and_has_no_batchnorm():
    model = DigitsCNN(num_classes=10, width=8)
    assert model(torch.rand(5, 1, 8, 8)).shape == (5, 10)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    with pytest.raises(ValueError, match="must be \\(batch, 1, 8, 8\\)"):
        model(torch.rand(5, 1, 28, 28))


def test_bad_digits_cnn_args_name_the_argument():
    with pytest.raises(ValueError, match="num_classes=1"):
        DigitsCNN(num_classes=1)
    with pytest.raises(ValueError, match="width=0"):
        DigitsCNN(width=0)


def test_digits_cnn_learns_digits(digits):
    torch.manual_seed(0)
    model = DigitsCNN(width=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(digits.train_dataset, batch_size=64, shuffle=True, drop_last=True, collate_fn=collate)
    for _ in range(2):
        for inputs, targets in loader:
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        predicted = model(digits.val_dataset.inputs).argmax(1)
    assert (predicted == digits.val_dataset.targets).float().mean().item() > 0.9


# --- presets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["charlm", "digits"])
def test_preset_nodes_are_constructor_arguments(name):
    cfg = OmegaConf.load(REPO / "conf" / "experiment" / f"{name}.yaml")
    assert {"override /model": None} in cfg.defaults and {"override /data": None} in cfg.defaults
    for node in ("model", "data"):
        module, _, attr = cfg[node]._target_.rpartition(".")
        parameters = inspect.signature(getattr(importlib.import_module(module), attr)).parameters
        keys = set(cfg[node]) - {"_target_"}
        assert keys <= set(parameters), f"{name}.yaml {node} keys not accepted: {keys - set(parameters)}"


def test_charlm_preset_is_a_language_model_whose_shapes_agree():
    cfg = OmegaConf.load(REPO / "conf" / "experiment" / "charlm.yaml")
    assert {"override /task": "language_model"} in cfg.defaults
    cfg.data.max_bytes = 20_000
    OmegaConf.resolve(cfg)
    model_args = {k: v for k, v in cfg.model.items() if k != "_target_"}
    data_args = {k: v for k, v in cfg.data.items() if k != "_target_"}
    data = StdlibText(**data_args)
    assert model_args["block_size"] == data.block_size and model_args["vocab_size"] == data.vocab_size
    inputs, targets = data.train_dataset.__getitems__(list(range(2)))
    logits = CharTransformer(**model_args)(inputs)
    assert logits.shape == (2, data.block_size, data.vocab_size)
    assert torch.isfinite(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def test_digits_preset_keeps_the_default_task():
    cfg = OmegaConf.load(REPO / "conf" / "experiment" / "digits.yaml")
    assert not any("override /task" in entry for entry in cfg.defaults)
    assert cfg.model.num_classes == DigitsData.num_classes
