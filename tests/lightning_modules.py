"""Lightning code as a Lightning project has it, for tests/test_lightning.py (importable by launched workers).

`LitClassifier` is shaped like lightning-hydra-template's MNISTLitModule (torchmetrics objects logged, the best
validation accuracy in on_validation_epoch_end, Adam with ReduceLROnPlateau on val/loss), on the runner's synthetic
data (`data=synthetic`: batches of (inputs, targets)); its constructor takes the `model=mlp` keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification.accuracy import Accuracy

from runner.data import SyntheticClassification


class GlobalBatchData(pl.LightningDataModule):
    """Keeps the global batch whatever the number of processes: setup() divides it by `self.trainer.world_size`
    (a LightningDataModule reads its Trainer so). Loaders as a LightningDataModule gives them."""

    def __init__(self, global_batch_size: int = 16, num_samples: int = 256, val_samples: int = 64,
                 num_features: int = 8, num_classes: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.global_batch_size = global_batch_size
        self.settings = dict(num_samples=num_samples, val_samples=val_samples, num_features=num_features,
                             num_classes=num_classes, seed=seed)
        self.batch_size: Optional[int] = None

    def setup(self, stage: str) -> None:
        self.batch_size = self.global_batch_size // self.trainer.world_size
        self.data = SyntheticClassification(batch_size=self.batch_size, **self.settings)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data.train_dataset, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data.val_dataset, batch_size=self.batch_size)


class LitClassifier(pl.LightningModule):
    """MNISTLitModule's shape: a net, a criterion, MeanMetric/Accuracy objects per stage logged with on_epoch=True,
    val/acc_best from on_validation_epoch_end, and Adam with ReduceLROnPlateau monitoring val/loss.

    `record` (a folder): each hook appends `<hook> <rank> <global_step> <current_epoch>` to `<record>/hooks`.
    """

    def __init__(self, in_features: int = 8, hidden: int = 16, depth: int = 2, num_classes: int = 4,
                 lr: float = 0.01, patience: int = 0, record: Optional[str] = None) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth - 1):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.net = nn.Sequential(*layers, nn.Linear(width, num_classes))
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=num_classes)
        self.val_acc = Accuracy(task="multiclass", num_classes=num_classes)
        self.test_acc = Accuracy(task="multiclass", num_classes=num_classes)
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _note(self, hook: str) -> None:
        if self.hparams.record:
            with open(Path(self.hparams.record) / "hooks", "a") as file:
                file.write(f"{hook} {self.global_rank} {self.global_step} {self.current_epoch}\n")

    def setup(self, stage: str) -> None:
        self._note(f"setup:{stage}")

    def on_train_start(self) -> None:
        self._note("on_train_start")
        self.val_loss.reset()
        self.val_acc.reset()
        self.val_acc_best.reset()

    def model_step(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self.forward(x)
        return self.criterion(logits, y), torch.argmax(logits, dim=1), y

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, preds, targets = self.model_step(batch)
        self.train_loss(loss)
        self.train_acc(preds, targets)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def on_train_epoch_start(self) -> None:
        self._note("on_train_epoch_start")

    def on_train_epoch_end(self) -> None:
        self._note("on_train_epoch_end")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        acc = self.val_acc.compute()
        self.val_acc_best(acc)
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.test_loss(loss)
        self.test_acc(preds, targets)
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_fit_end(self) -> None:
        self._note("on_fit_end")

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.Adam(self.trainer.model.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5,
                                                               patience=self.hparams.patience)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss", "interval": "epoch", "frequency": 1}}


class LitPlain(pl.LightningModule):
    """The shortest LightningModule: a loss tensor from training_step, `self.log` of tensors and numbers, an SGD
    optimizer returned as such. `skip_every` > 0: training_step returns None for every `skip_every`-th batch."""

    def __init__(self, in_features: int = 8, hidden: int = 16, depth: int = 2, num_classes: int = 4,
                 lr: float = 0.1, skip_every: int = 0) -> None:
        super().__init__()
        self.lr, self.skip_every = lr, skip_every
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss_seen", loss)
        self.log("world", float(self.trainer.world_size))
        if self.skip_every and batch_idx % self.skip_every == self.skip_every - 1:
            return None  # skipped after logging, as a guard against a bad batch does
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val/loss", nn.functional.cross_entropy(logits, y))
        self.log("val/acc", (logits.argmax(dim=1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class LitOneCycle(LitPlain):
    """([optimizer], [{scheduler, interval: step}]) with OneCycleLR over self.trainer.estimated_stepping_batches;
    sets self.trainer.should_stop in on_train_batch_end once global_step reaches `stop_at` (0: never)."""

    def __init__(self, stop_at: int = 0, **settings: Any) -> None:
        super().__init__(**settings)
        self.stop_at = stop_at

    def configure_optimizers(self) -> tuple[list, list]:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr,
                                                        total_steps=self.trainer.estimated_stepping_batches)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.stop_at and self.global_step >= self.stop_at:
            self.trainer.should_stop = True


class StepsItself(LitPlain):
    """Overrides optimizer_step: refused before launch."""

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


class LitPredicts(LitPlain):
    """predict_step: the class probabilities of a batch's inputs; on_predict_batch_start counts the batches."""

    predict_batches = 0

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        return torch.softmax(self.net(x), dim=-1)

    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        assert batch_idx == self.predict_batches and self.trainer.predicting
        self.predict_batches += 1


class TwoOptimizersAutomatic(LitPlain):
    """Two optimizers with automatic optimization: refused before launch (Lightning 2 refuses it too)."""

    def configure_optimizers(self) -> list:
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


class ManualTwoOptimizers(LitPlain):
    """Manual optimization, a GAN's alternating steps on a classifier: the head steps first on the body's features
    detached (clipped with self.clip_gradients when `clip` > 0), then the body through the updated head, with only the
    body's parameters taking gradients (`toggle_model`); each optimizer's StepLR stepped by the module at every step.
    Returns nothing: the logged losses are the metrics."""

    def __init__(self, clip: float = 0.0, **settings: Any) -> None:
        super().__init__(**settings)
        self.automatic_optimization = False
        self.clip = clip

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        head_optimizer, body_optimizer = self.optimizers()
        features = torch.relu(self.net[0](x))
        head_loss = nn.functional.cross_entropy(self.net[2](features.detach()), y)
        head_optimizer.zero_grad()
        self.manual_backward(head_loss)
        if self.clip:
            self.clip_gradients(head_optimizer, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        head_optimizer.step()
        with body_optimizer.toggle_model():
            body_loss = nn.functional.cross_entropy(self.net[2](features), y)
            body_optimizer.zero_grad()
            self.manual_backward(body_loss)
            body_optimizer.step()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        self.log("head_loss", head_loss)
        self.log("body_loss", body_loss)

    def configure_optimizers(self) -> tuple[list, list]:
        head = torch.optim.SGD(self.net[2].parameters(), lr=self.lr, momentum=0.9)
        body = torch.optim.Adam(self.net[0].parameters(), lr=self.lr / 10)
        return [head, body], [torch.optim.lr_scheduler.StepLR(head, step_size=2, gamma=0.5),
                              torch.optim.lr_scheduler.StepLR(body, step_size=3, gamma=0.5)]


class RecordingCallback(pl.Callback):
    """A user's own Lightning callback: notes its hooks in `<folder>/callback` with what the trainer view says."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.validations = 0

    def _note(self, line: str) -> None:
        with open(self.folder / "callback", "a") as file:
            file.write(line + "\n")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._note(f"on_fit_start {trainer.global_rank}/{trainer.world_size} {type(pl_module).__name__}")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.validations += 1
        self._note(f"on_validation_end {trainer.global_rank} {trainer.global_step} "
                   f"{float(trainer.callback_metrics['val/loss']):.6f}")

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._note(f"on_train_epoch_end {trainer.global_rank} {trainer.current_epoch}")

    def state_dict(self) -> dict:
        return {"validations": self.validations}

    def load_state_dict(self, state: dict) -> None:
        self.validations = state["validations"]


class SanityCallback(pl.Callback):
    """Overrides on_sanity_check_start, which the runner never calls: refused before launch."""

    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        pass


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class RaisingCallback(pl.Callback):
    """A user's Lightning callback whose on_train_epoch_start raises."""

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        raise RuntimeError("injected failure in a Lightning callback")


class RaisesOnTrainStart(LitPlain):
    """A LightningModule whose on_train_start raises."""

    def on_train_start(self) -> None:
        raise RuntimeError("injected failure in a module hook")


class LitOwnNames(LitPlain):
    """Logs its validation metrics under names of its own (val/lit_loss, val/lit_acc; no val/loss: validation_step
    returns nothing). `plateau`: a ReduceLROnPlateau (mode max) watching val/lit_acc, the module's own monitor."""

    def __init__(self, plateau: bool = False, **settings: Any) -> None:
        super().__init__(**settings)
        self.plateau = plateau

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val/lit_loss", nn.functional.cross_entropy(logits, y))
        self.log("val/lit_acc", (logits.argmax(dim=1) == y).float().mean())

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if not self.plateau:
            return optimizer
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val/lit_acc"}}


class LitCalibrated(LitOneCycle):
    """LitOneCycle with a buffer of its own (a fine-tuned model's calibration): a checkpoint of LitPlain lacks it."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.register_buffer("calibration", torch.ones(4))


class LitMedia(LitPlain):
    """Logs through Lightning's logger surface, as a Lightning project does: hyperparameters of its own at the start,
    and at each validation's first batch an image and a histogram (self.logger.experiment: TensorBoard's
    SummaryWriter), a scalar (self.logger.log_metrics), a file in self.logger.log_dir, and how many loggers it sees."""

    def on_train_start(self) -> None:
        for logger in self.loggers:  # as lightning-hydra-template logs its hyperparameters
            logger.log_hyperparams({"user": {"depth": 2, "note": "mine"}})

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.log("seen_loggers", float(len(self.loggers)))
        if batch_idx:
            return
        self.logger.experiment.add_image("val/sample", torch.rand(3, 8, 8), self.global_step)
        self.logger.experiment.add_histogram("weights/first", self.net[0].weight, self.global_step)
        self.logger.log_metrics({"custom/metric": 1.5 + self.global_step}, step=self.global_step)
        folder = Path(self.logger.log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"seen-{self.global_rank}").write_text(str(self.global_step))
