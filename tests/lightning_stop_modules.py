"""A LightningModule that sets trainer.should_stop on some processes only (tests/test_lightning_stop.py)."""

from __future__ import annotations

from typing import Any

from lightning_modules import LitPlain


class StopOnRanks(LitPlain):
    """Sets self.trainer.should_stop in on_train_batch_end from global step `stop_at`, on the processes `ranks`."""

    def __init__(self, stop_at: int, ranks: list[int], **settings: Any) -> None:
        super().__init__(**settings)
        self.stop_at, self.ranks = stop_at, list(ranks)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_step >= self.stop_at and self.global_rank in self.ranks:
            self.trainer.should_stop = True
