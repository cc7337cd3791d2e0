"""`trainer.compile`: the model and loss run through torch.compile, train the same, and checkpoint the same keys."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import pytest
import torch
from omegaconf import DictConfig

import runner
from conftest import load_checkpoint

MakeCfg = Callable[..., DictConfig]
COMMON = ("optimizer=sgd", "trainer.max_steps=4", "trainer.log_every_n_steps=2")


def compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values())


def test_compiled_runs_train_what_eager_runs_train(make_cfg: MakeCfg, tmp_path: Path) -> None:
    torch._dynamo.reset()
    eager = runner.fit(make_cfg(*COMMON), run_dir=tmp_path / "eager")
    before = compiled_frames()
    # The eager backend traces with dynamo and runs the captured graph as is: the plumbing without a compiler.
    compiled = runner.fit(make_cfg(*COMMON, "trainer.compile={backend:eager}"), run_dir=tmp_path / "compiled")
    assert compiled_frames() > before, "dynamo traced nothing: the model was not compiled"
    log = (tmp_path / "compiled" / "runner.log").read_text()
    start = log.index("trainer.compile: torch.compile (backend=eager) compiles the model with its loss during the "
                      "first step, so the first steps are slow")
    took = re.search(r"trainer.compile: the first step took (\d+\.\d) s, compilation included", log)
    assert took and start < took.start() < log.index("step 2/4")
    assert log.count("trainer.compile:") == 2
    assert "trainer.compile" not in (tmp_path / "eager" / "runner.log").read_text()
    assert compiled["val/loss"] == pytest.approx(eager["val/loss"], abs=1e-6)
    assert compiled["train/loss"] == pytest.approx(eager["train/loss"], abs=1e-6)
    saved, reference = load_checkpoint(tmp_path / "compiled")["model"], load_checkpoint(tmp_path / "eager")["model"]
    assert saved.keys() == reference.keys()  # no `_orig_mod.` prefix: loads into an uncompiled model
    for name, tensor in reference.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=1e-6)


def test_a_compiled_run_resumes_from_an_eager_checkpoint(make_cfg: MakeCfg, tmp_path: Path) -> None:
    runner.fit(make_cfg(*COMMON, "trainer.max_steps=2"), run_dir=tmp_path)
    resumed = runner.fit(make_cfg(*COMMON, "trainer.compile={backend:eager}", "trainer.ckpt_path=last"),
                         run_dir=tmp_path)
    assert resumed["step"] == 4


def test_compile_true_uses_the_default_compiler(make_cfg: MakeCfg, tmp_path: Path) -> None:
    """inductor, torch.compile's default: generates and builds C++ kernels on the CPU (needs a C++ compiler)."""
    torch._dynamo.reset()
    eager = runner.fit(make_cfg(*COMMON), run_dir=tmp_path / "eager")
    compiled = runner.fit(make_cfg(*COMMON, "trainer.compile=true"), run_dir=tmp_path / "compiled")
    assert compiled["val/loss"] == pytest.approx(eager["val/loss"], abs=1e-4)


def test_ddp_workers_compile_and_match_one_process_on_the_global_batch(make_cfg: MakeCfg, tmp_path: Path) -> None:
    compiled = ("trainer.compile={backend:eager}", *COMMON)
    runner.fit(make_cfg(*compiled, "data.batch_size=32"), run_dir=tmp_path / "one")
    runner.fit(make_cfg(*compiled, "strategy=ddp", "trainer.devices=2", "data.batch_size=16"), run_dir=tmp_path / "two")
    one, two = load_checkpoint(tmp_path / "one")["model"], load_checkpoint(tmp_path / "two")["model"]
    assert one.keys() == two.keys()
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, rtol=0, atol=1e-5)
