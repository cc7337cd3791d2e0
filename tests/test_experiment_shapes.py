"""Tests for the shapes example experiment: data, model, learnability and its Hydra preset."""

import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from runner.examples.shapes import ShapesData, SmallCNN

REPO = Path(__file__).resolve().parents[1]


def small(**kwargs) -> ShapesData:
    args = {"num_samples": 400, "val_samples": 100} | kwargs
    return ShapesData(**args)


def test_same_seed_gives_identical_data_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = small(seed=3), small(seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.train_dataset.images, b.train_dataset.images)
    assert torch.equal(a.train_dataset.labels, b.train_dataset.labels)
    assert torch.equal(a.val_dataset.images, b.val_dataset.images)


def test_different_seed_and_split_give_different_data():
    a, b = small(seed=0), small(seed=1)
    assert not torch.equal(a.train_dataset.images, b.train_dataset.images)
    assert not torch.equal(a.val_dataset.images, b.val_dataset.images)
    same_size = small(num_samples=100, val_samples=100)
    assert not torch.equal(same_size.train_dataset.images, same_size.val_dataset.images)


@pytest.mark.parametrize("num_classes,image_size", [(4, 28), (2, 16), (3, 32)])
def test_shapes_dtypes_and_balanced_labels(num_classes, image_size):
    data = small(num_classes=num_classes, image_size=image_size, batch_size=32)
    assert (data.batch_size, data.num_workers, data.pin_memory) == (32, 0, False)
    for dataset, n in [(data.train_dataset, 400), (data.val_dataset, 100)]:
        assert len(dataset) == n
        image, target = dataset[0]
        assert image.shape == (1, image_size, image_size) and image.dtype == torch.float32
        assert isinstance(target, int)
        counts = torch.bincount(dataset.labels, minlength=num_classes)
        assert len(counts) == num_classes
        assert (counts - n / num_classes).abs().max() <= 0.05 * n


def test_every_image_shows_a_shape():
    images = small(noise=0.0).train_dataset.images
    lit = (images > 0).flatten(1)
    assert lit.any(1).all() and (lit.sum(1) < lit.shape[1]).all()
    peaks = images.flatten(1).amax(1)
    assert peaks.min() >= 0.5 and peaks.max() <= 1.0


def test_getitems_matches_getitem_and_collates():
    dataset = small().train_dataset
    indices = [5, 0, 399, 17, 5]
    batch = dataset.__getitems__(indices)
    for (image, target), i in zip(batch, indices):
        ref_image, ref_target = dataset[i]
        assert torch.equal(image, ref_image) and target == ref_target
    inputs, targets = next(iter(DataLoader(dataset, batch_size=64)))
    assert inputs.shape == (64, 1, 28, 28) and targets.dtype == torch.int64
    assert torch.equal(targets, dataset.labels[:64])


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"num_samples": 0}, "num_samples=0"),
        ({"val_samples": -1}, "val_samples=-1"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"num_classes": 1}, "num_classes=1"),
        ({"num_classes": 5}, "num_classes=5"),
        ({"image_size": 15}, "image_size=15"),
        ({"noise": -0.1}, "noise=-0.1"),
        ({"num_workers": -1}, "num_workers=-1"),
    ],
)
def test_bad_data_args_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ShapesData(**kwargs)


def test_bad_model_args_name_the_argument():
    with pytest.raises(ValueError, match="image_size=4"):
        SmallCNN(image_size=4)
    with pytest.raises(ValueError, match="width=0"):
        SmallCNN(width=0)


@pytest.mark.parametrize("image_size", [16, 28, 33])
def test_model_gives_logits(image_size):
    model = SmallCNN(num_classes=3, width=8, image_size=image_size)
    assert model(torch.randn(5, 1, image_size, image_size)).shape == (5, 3)


def test_small_cnn_learns_shapes():
    torch.manual_seed(0)
    data = ShapesData(num_samples=2000, val_samples=500)
    model = SmallCNN(width=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(data.train_dataset, batch_size=64, shuffle=True)
    step = 0
    while step < 200:
        for inputs, targets in loader:
            loss = torch.nn.CrossEntropyLoss()(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step == 200:
                break
    model.eval()
    with torch.no_grad():
        predicted = model(data.val_dataset.images).argmax(1)
    accuracy = (predicted == data.val_dataset.labels).float().mean().item()
    assert accuracy > 0.8


def write_primary_config(root: Path) -> None:
    """A minimal primary config with the groups and defaults runner's own config has."""
    files = {
        "config.yaml": "defaults:\n  - trainer: default\n  - model: mlp\n  - data: synthetic\n"
        "  - optimizer: adamw\n  - _self_\n  - experiment: null\n",
        "trainer/default.yaml": "max_epochs: 1\nval_check_interval: 1.0\n",
        "optimizer/adamw.yaml": "_target_: torch.optim.AdamW\n_partial_: true\nlr: 0.1\n"
        "weight_decay: 0.01\n",
        "model/mlp.yaml": "_target_: torch.nn.Linear\nin_features: ${data.num_features}\n"
        "hidden: 8\ndepth: 1\nnum_classes: ${data.num_classes}\n",
        "data/synthetic.yaml": "_target_: builtins.dict\nnum_samples: 16\nval_samples: 8\n"
        "num_features: 4\nnum_classes: 2\nbatch_size: 4\nseed: 0\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "experiment").mkdir()
    shutil.copy(REPO / "conf" / "experiment" / "shapes.yaml", root / "experiment" / "shapes.yaml")


def test_preset_replaces_model_and_data_and_builds(tmp_path):
    write_primary_config(tmp_path)
    overrides = ["experiment=shapes", "data.num_samples=64", "data.val_samples=16"]
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    assert cfg.model._target_ == "runner.examples.shapes.SmallCNN"
    assert cfg.data._target_ == "runner.examples.shapes.ShapesData"
    assert not {"in_features", "hidden", "depth"} & set(cfg.model)
    assert "num_features" not in cfg.data
    assert cfg.optimizer.weight_decay == 0.01 and cfg.optimizer.lr == 0.003
    assert cfg.trainer.val_check_interval == 1.0
    OmegaConf.resolve(cfg)
    model, data = instantiate(cfg.model), instantiate(cfg.data)
    inputs, targets = next(iter(DataLoader(data.train_dataset, batch_size=data.batch_size)))
    logits = model(inputs)
    assert logits.shape == (data.batch_size, cfg.data.num_classes)
    assert torch.isfinite(torch.nn.CrossEntropyLoss()(logits, targets))
