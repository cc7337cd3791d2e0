"""A LightningModule in lightning-hydra-template's shape (MNISTLitModule: the net and a `_partial_` optimizer and
scheduler are nested `_target_` nodes of its config, configure_optimizers calls them), a small CNN for it, and
3-channel images to train on, for the stage=check tests."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification.accuracy import Accuracy


class SmallCNN(nn.Module):
    """conv (in_channels -> 8) -> ReLU -> global average pool -> linear over num_classes."""

    def __init__(self, in_channels: int = 3, num_classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(in_channels, 8, kernel_size=3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class ImageData:
    """Random `channels` x `size` x `size` images with labels from their mean colour (no download)."""

    def __init__(self, num_samples: int = 64, val_samples: int = 32, channels: int = 3, size: int = 8,
                 num_classes: int = 4, batch_size: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.batch_size = batch_size

        def make(n: int) -> torch.utils.data.TensorDataset:
            images = torch.rand(n, channels, size, size, generator=generator)
            labels = (images.mean(dim=(1, 2, 3)) * num_classes).long().clamp(max=num_classes - 1)
            return torch.utils.data.TensorDataset(images, labels)

        self.train_dataset, self.val_dataset = make(num_samples), make(val_samples)


class LitTemplate(pl.LightningModule):
    """MNISTLitModule's shape: `net`, `optimizer` and `scheduler` are given built (the optimizer and scheduler as
    partials), the loss and accuracy logged per step, and configure_optimizers calls the partials."""

    def __init__(self, net: nn.Module, optimizer: Any, scheduler: Optional[Any] = None, num_classes: int = 4,
                 compile: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False, ignore=["net"])
        self.net = net
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=num_classes)
        self.val_loss = MeanMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.criterion(logits, y)
        self.train_acc(logits.argmax(dim=1), y)
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_loss(self.criterion(self(x), y))
        self.log("val/loss", self.val_loss, on_epoch=True)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        if self.hparams.scheduler is None:
            return {"optimizer": optimizer}
        scheduler = self.hparams.scheduler(optimizer=optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss"}}


class ValidationBreaks(LitTemplate):
    """validation_step reads the batch as a dict, which the data's batches are not: only evaluation fails."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.criterion(self(batch["image"]), batch["label"]))
