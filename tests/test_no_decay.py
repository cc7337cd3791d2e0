"""optimizer._no_decay_: biases, normalization layers or named parameters in a group of their own with
weight_decay 0.0; an entry that matches no parameter is refused before any worker starts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import pytest
import torch
from omegaconf import DictConfig

import runner
from runner.build import build_optimizer
from runner.checks import validate
from runner.config import ConfigError

from conftest import load_checkpoint
from data_info_fixtures import NormNet

MakeCfg = Callable[..., DictConfig]
LR, WD = 0.003, 0.01  # conf/optimizer/adamw.yaml


def _names(model: torch.nn.Module, group: dict) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in group["params"]]


@pytest.mark.parametrize(("entries", "exempt"), [
    ("[bias,norm]", ["fc1.bias", "ln.weight", "ln.bias", "bn.weight", "bn.bias", "rms.weight", "head.bias"]),
    ("[bias]", ["fc1.bias", "ln.bias", "bn.bias", "head.bias"]),
    ("[norm,pos_embed]", ["pos_embed", "ln.weight", "ln.bias", "bn.weight", "bn.bias", "rms.weight"]),
], ids=["bias-norm", "bias", "norm-and-a-name"])
def test_the_groups_hold_exactly_the_named_parameters(make_cfg: MakeCfg, entries: str, exempt: list[str]) -> None:
    model = NormNet()
    optimizer = build_optimizer(make_cfg(f"optimizer._no_decay_={entries}"), model)
    decayed, kept = optimizer.param_groups
    assert _names(model, kept) == exempt and kept["weight_decay"] == 0.0
    assert optimizer.state_dict()["parameter_names"] == _names(model, decayed) + exempt  # what sharded state is keyed by
    assert _names(model, decayed) == [n for n, _ in model.named_parameters() if n not in exempt]
    assert decayed["weight_decay"] == WD
    # With zero gradients AdamW's step is its decay alone: p * (1 - lr * wd) in the first group, nothing in the other.
    before = {n: p.detach().clone() + 1.0 for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for n, p in model.named_parameters():
        factor = 1.0 if n in exempt else 1 - LR * WD
        torch.testing.assert_close(p.detach(), before[n] * factor, rtol=0, atol=1e-7)


def test_without_entries_one_group_as_before(make_cfg: MakeCfg) -> None:
    model = NormNet()
    (group,) = build_optimizer(make_cfg(), model).param_groups
    assert _names(model, group) == [n for n, _ in model.named_parameters()] and group["weight_decay"] == WD


@pytest.mark.parametrize(("entries", "message"), [
    ("[bias,embedz]", r"^optimizer\._no_decay_: embedz matches no parameter of model \(runner\.models\.MLP\); use "
                      r"bias .* such as net\.0\.weight, net\.0\.bias"),
    ("[norm]", r"^optimizer\._no_decay_: norm matches no parameter of model \(runner\.models\.MLP\)"),
    ("bias", r"^optimizer\._no_decay_=bias must be a list of names: bias, norm"),
    ("[bias] optimizer=sgd", r"^optimizer\._no_decay_=\['bias'\] exempts parameters from a weight decay of 0"),
    ("[bias] optimizer.weight_decay=0.0", r"^optimizer\._no_decay_=\['bias'\] exempts parameters from a weight "
                                          r"decay of 0"),
], ids=["unknown-name", "no-norm-layer", "not-a-list", "sgd-without-decay", "decay-zero"])
def test_unusable_settings_are_refused_in_one_line(make_cfg: MakeCfg, entries: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        validate(make_cfg(*f"optimizer._no_decay_={entries}".split()))
    assert len(error.value.problems) == 1
    assert re.search(message, error.value.problems[0]), error.value.problems


def test_ddp_trains_with_the_two_groups_as_one_process_does(make_cfg: MakeCfg, tmp_path: Path) -> None:
    """2 processes x 8 samples train what 1 process x 16 trains, with the biases exempt from decay."""
    common = ("optimizer._no_decay_=[bias]", "optimizer.weight_decay=0.5")
    runner.fit(make_cfg(*common), run_dir=tmp_path / "one")
    runner.fit(make_cfg(*common, "strategy=ddp", "trainer.devices=2", "data.batch_size=8"), run_dir=tmp_path / "two")
    one, two = load_checkpoint(tmp_path / "one"), load_checkpoint(tmp_path / "two")
    groups = two["optimizer"]["param_groups"]
    # MLP 8 -> 16 -> 16 -> 4: the weights net.0, net.2, net.4 first, then their biases
    assert [(g["weight_decay"], g["params"]) for g in groups] == [(0.5, [0, 1, 2]), (0.0, [3, 4, 5])]
    assert two["step"] == one["step"] == 3
    for name, value in one["model"].items():
        torch.testing.assert_close(two["model"][name], value, rtol=0, atol=1e-6)


def test_resuming_with_other_groups_names_the_groups(make_cfg: MakeCfg, tmp_path: Path) -> None:
    """A checkpoint trained with one group, resumed with _no_decay_'s two: refused, naming the groups (the settings
    of each group are the same, so naming settings said nothing)."""
    runner.fit(make_cfg(), run_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"the checkpoint's optimizer has 1 parameter group\(s\), this run's 2 "
                                          r"\(optimizer\._no_decay_ makes a second one\)"):
        runner.fit(make_cfg("optimizer._no_decay_=[bias]", "trainer.max_steps=5", "trainer.ckpt_path=last"),
                   run_dir=tmp_path)
