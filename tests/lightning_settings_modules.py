"""A LightningModule for tests/test_lightning_settings.py (importable by launched workers): the settings a Lightning
project turns on, each observable in the run's numbers.

`LitSettings` is lightning-hydra-template's module shape on the runner's synthetic data: a net, cross-entropy, a
torchmetrics Accuracy logged each step, SGD with momentum (or Adam: `optimizer="adam"`) from configure_optimizers,
and `torch.compile(self.net)` in `setup("fit")` when `compile` names a backend (the template compiles there). What it saw is logged, so a run's metrics say it:
`train/low_precision` (the logits were bfloat16 or float16: an autocast was on), `train/compiled` (the net it called
was a compiled one), `train/world` (the trainer's world size).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics.classification.accuracy import Accuracy

from runner.models import MLP


class LitSettings(pl.LightningModule):
    def __init__(self, in_features: int = 8, hidden: int = 16, depth: int = 2, num_classes: int = 4,
                 lr: float = 0.1, compile: str | None = None, optimizer: str = "sgd") -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net: nn.Module = MLP(in_features, hidden, depth, num_classes)
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=num_classes)
        self.val_acc = Accuracy(task="multiclass", num_classes=num_classes)

    def setup(self, stage: str) -> None:
        if self.hparams.compile and stage == "fit":
            self.net = torch.compile(self.net, backend=self.hparams.compile)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.forward(x)
        loss = self.criterion(logits, y)
        self.train_acc(torch.argmax(logits, dim=1), y)
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True)
        self.log("train/low_precision", float(logits.dtype in (torch.bfloat16, torch.float16)))
        self.log("train/compiled", float(hasattr(self.net, "_orig_mod")))
        self.log("train/world", float(self.trainer.world_size))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.forward(x)
        self.val_acc(torch.argmax(logits, dim=1), y)
        self.log("val/loss", self.criterion(logits.float(), y))
        self.log("val/acc", self.val_acc)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr / 10)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class LitHookOrder(LitSettings):
    """LitSettings that appends `<hook> idx=<batch_idx> gs=<global_step>` to `<record>/hooks` for the per-batch
    hooks, the order Lightning's Trainer documents and runs them in."""

    def __init__(self, record: str, **settings: Any) -> None:
        super().__init__(**settings)
        self.record = record

    def _note(self, line: str) -> None:
        with open(f"{self.record}/hooks", "a") as file:
            file.write(f"{line} gs={self.trainer.global_step}\n")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._note(f"on_train_batch_start idx={batch_idx}")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._note(f"training_step idx={batch_idx}")
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._note("on_before_optimizer_step")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._note(f"on_train_batch_end idx={batch_idx}")
