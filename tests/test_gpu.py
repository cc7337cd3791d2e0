"""GPU paths, end to end through the CLI: DataParallel, DDP over nccl, mixed and half precision, pinned memory.

Run on a GPU machine with `pytest -m cuda`; without CUDA every test here is skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TINY = ["data.num_samples=2048", "data.val_samples=300", "trainer.max_steps=20", "trainer.log_every_n_steps=5"]


def run(tmp_path: Path, *args: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "runner", *args, *TINY, f"hydra.run.dir={tmp_path}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads((tmp_path / "metrics.json").read_text())


def test_dataparallel_over_all_gpus(tmp_path: Path) -> None:
    metrics = run(tmp_path, "strategy=dp", "accelerator=cuda", "trainer.devices=-1")
    assert metrics["step"] == 20 and metrics["val/loss"] > 0


def test_ddp_with_nccl(tmp_path: Path) -> None:
    devices = min(2, torch.cuda.device_count())
    run(tmp_path, "strategy=ddp", "accelerator=cuda", f"trainer.devices={devices}")
    assert (tmp_path / "metrics.json").exists()
    assert devices == 1 or (tmp_path / "rank_1.log").exists()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "bf16-true", "16-true"])
def test_precision_on_cuda(tmp_path: Path, precision: str) -> None:
    metrics = run(tmp_path, "accelerator=cuda", "trainer.devices=1", f"precision={precision}")
    assert metrics["val/loss"] == metrics["val/loss"]  # not NaN


def test_16_mixed_scaler_state_is_saved_and_restored(tmp_path: Path) -> None:
    first = tmp_path / "first"
    run(first, "accelerator=cuda", "trainer.devices=1", "precision=16-mixed")
    checkpoint = torch.load(first / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["precision"]["scale"] > 0
    second = tmp_path / "second"
    metrics = run(second, "accelerator=cuda", "trainer.devices=1", "precision=16-mixed", "trainer.max_steps=30",
                  f"trainer.ckpt_path={first / 'checkpoints' / 'last.ckpt'}")
    assert metrics["step"] == 30


def test_cuda_checkpoint_loads_on_cpu(tmp_path: Path) -> None:
    run(tmp_path, "accelerator=cuda", "trainer.devices=1")
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert all(t.device.type == "cpu" for t in checkpoint["model"].values())


def test_pinned_memory_loading(tmp_path: Path) -> None:
    run(tmp_path, "accelerator=cuda", "trainer.devices=1", "data.pin_memory=true", "data.num_workers=1")
