"""Lightning's Trainer, loggers and callbacks named in a config (a lightning-hydra-template tree names them), and what
the runner has instead: matched on the `_target_` string, so lightning is never imported to tell. Read while a
config is composed (runner.composition) and checked (runner.checks.keys, runner.lightning.checks)."""

from __future__ import annotations

from typing import Any, Optional


_TRAINER = ("is Lightning's Trainer; the runner's trainer group is plain values (trainer.max_epochs, trainer.devices, "
            "...: no _target_), with accelerator, strategy and precision as groups of their own")
_RUNNERS_OWN = {
    "CSVLogger": "logger=csv", "TensorBoardLogger": "logger=tensorboard", "WandbLogger": "logger=wandb",
    "MLFlowLogger": "logger=mlflow", "ModelCheckpoint": "callbacks=model_checkpoint",
    "EarlyStopping": "callbacks=early_stopping", "ModelSummary": "callbacks=model_summary",
    "RichModelSummary": "callbacks=model_summary", "RichProgressBar": "trainer.progress_bar=true",
    "TQDMProgressBar": "trainer.progress_bar=true",
}


def lightning_class(key: str, target: Any) -> Optional[str]:
    """The line for a `_target_` naming Lightning's Trainer or one of its stock loggers or callbacks, else None."""
    if not isinstance(target, str) or target.split(".")[0] not in ("lightning", "pytorch_lightning"):
        return None
    name = target.rpartition(".")[2]
    if name == "Trainer":
        return f"{key}: {target} {_TRAINER}"
    if name == "LearningRateMonitor":
        return f"{key}: {target} is Lightning's; the runner needs none: every logger gets lr at each log step"
    if name in _RUNNERS_OWN:
        return f"{key}: {target} is Lightning's; the runner's is {_RUNNERS_OWN[name]}"
    return None


def lightning_classes(node: Any, key: str = "") -> list[str]:
    """A line for each Lightning Trainer, logger or callback named in `node` (plain containers), by its key."""
    if isinstance(node, dict):
        own = lightning_class(key or "<top>", node.get("_target_"))
        return [*([own] if own else []),
                *(line for k, v in node.items() for line in lightning_classes(v, f"{key}.{k}" if key else str(k)))]
    if isinstance(node, list):
        return [line for i, v in enumerate(node) for line in lightning_classes(v, f"{key}[{i}]")]
    return []
