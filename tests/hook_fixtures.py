"""A callback that records the hooks it gets, named by `+callbacks.rec._target_=hook_fixtures.Recorder` in hook tests
(launched workers import it from tests/: PYTHONPATH)."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import torch


def collecting() -> bool:
    """Whether Python's collector collects by itself now: on, with a first threshold."""
    return gc.isenabled() and gc.get_threshold()[0] > 0


# A process the runner started imports the modules its config names with the collector paused (runner.collector);
# a launched worker imports them seeded, as its builds would.
COLLECTING_AT_IMPORT, SEED_AT_IMPORT = collecting(), torch.initial_seed()


class Recorder:
    """Appends one JSON line per hook call to `<folder>/rank_<r>.jsonl`, with what the hook saw."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def _write(self, **event: Any) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rank_{os.environ.get('RANK', '0')}.jsonl", "a") as file:
            file.write(json.dumps(event) + "\n")

    def on_before_optimizer_step(self, loop: Any, optimizer: Any) -> None:
        grads = [p.grad for p in loop.task.parameters()]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None))
        self._write(hook="on_before_optimizer_step", step=loop.progress.step + 1, norm=float(norm),
                    all_grads=all(g is not None for g in grads), same_optimizer=optimizer is loop.optimizer)

    def on_train_batch_end(self, loop: Any, outputs: list, step: int) -> None:
        self._write(hook="on_train_batch_end", step=step, micro_batches=len(outputs),
                    keys=sorted(outputs[0]), samples=sum(_samples(loop, out) for out in outputs),
                    grads_cleared=all(p.grad is None for p in loop.task.parameters()))

    def on_validation_start(self, loop: Any) -> None:
        self._write(hook="on_validation_start", step=loop.progress.step)

    def on_validation_batch_end(self, loop: Any, out: dict, batch_index: int) -> None:
        self._write(hook="on_validation_batch_end", index=batch_index, samples=_samples(loop, out))

    def on_validation_epoch_end(self, loop: Any) -> None:
        self._write(hook="on_validation_epoch_end", step=loop.progress.step)

    def on_validation_end(self, loop: Any, metrics: dict, step: int) -> None:
        self._write(hook="on_validation_end", step=step)

    def on_fit_end(self, loop: Any, result: dict) -> None:
        self._write(hook="on_fit_end", grad_norm=loop.progress.metrics.get("train/grad_norm"),
                    collecting_at_import=COLLECTING_AT_IMPORT, collecting=collecting(), frozen=gc.get_freeze_count(),
                    seed_at_import=SEED_AT_IMPORT)


def _samples(loop: Any, out: dict) -> int:
    return int(out["stats"][:, loop.task.task.stat_names.index("samples")].sum())


def events(folder: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (Path(folder) / f"rank_{rank}.jsonl").read_text().splitlines()]


class Media:
    """A runner callback that logs a histogram and a text at each validation through runner.loggers (to whichever
    loggers the run has), as a plain module's user would."""

    def on_validation_end(self, loop: Any, metrics: dict, step: int) -> None:
        from runner import loggers

        model = loop.strategy.unwrap(loop.wrapped).model
        loggers.log_histogram("callback/weights", next(model.parameters()))
        loggers.log_text("callback/note", f"validated at step {step}")
