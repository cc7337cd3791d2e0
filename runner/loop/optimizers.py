"""Several optimizers as the one optimizer the loop, its checkpoint and its logs know: their parameter groups in
order, one state_dict holding each optimizer's, zero_grad and step over all of them."""

from __future__ import annotations

from typing import Any, Optional

import torch


class OptimizerSet:
    """The optimizers a model's parts train with (a LightningModule's configure_optimizers() list), in their order.

    `param_groups` is every optimizer's groups in order (the same dicts: a learning rate set there is the optimizer's),
    so the lr log, a resume's settings and a loss scaler's unscale see each group once. `state_dict()` keeps each
    optimizer's own state dict under "optimizers", and the groups under "param_groups" as one optimizer's would be,
    so a checkpoint of another optimizer (or another count of them) is refused by the same checks.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        return {key: value for optimizer in self.optimizers for key, value in optimizer.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Any] = None) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def state_dict(self) -> dict:
        states = [optimizer.state_dict() for optimizer in self.optimizers]
        return {"state": {}, "param_groups": [group for state in states for group in state["param_groups"]],
                "optimizers": states, "classes": [type(optimizer).__name__ for optimizer in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        from runner.config import ConfigError

        saved = state.get("optimizers")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            count = len(saved) if isinstance(saved, list) else 1
            raise ConfigError([f"trainer.ckpt_path: the checkpoint holds {count} optimizer(s), this run has "
                               f"{len(self.optimizers)} ({self}); resume with the optimizers it was trained with"])
        for optimizer, optimizer_state in zip(self.optimizers, saved):
            optimizer.load_state_dict(optimizer_state)

    def __repr__(self) -> str:
        return f"OptimizerSet({', '.join(type(optimizer).__name__ for optimizer in self.optimizers)})"


def optimizers_of(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The optimizers behind the loop's optimizer: a set's, or the one."""
    return list(optimizer.optimizers) if isinstance(optimizer, OptimizerSet) else [optimizer]
