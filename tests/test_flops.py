"""The model FLOP rate and MFU in the throughput metrics, and the CUDA fast path's decisions (fused optimizers, TF32),
checked on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

import runner
from runner import build
from runner.checks import validate
from runner.config import ConfigError
from runner.examples.charlm import CharTransformer
from runner.flops import StepFlops, count_flops, meta_twin, peak_tflops, precision_kind
from runner.precision import MixedPrecision, Precision
from runner.precision.precision import set_tf32_settings, tf32_settings
from runner.tasks import LanguageModelTask, TaskModule

MakeCfg = Callable[..., DictConfig]


def hand_count(model: CharTransformer, batch: int, block: int) -> float:
    """6 x non-embedding parameters x tokens (forward 2, backward 4), plus attention's two (T x T) products per layer:
    forward 2 x 2 x T x d_model per token, times 3 with the backward: 12 x layers x d_model x T per token."""
    embeddings = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embeddings
    d_model, layers, tokens = model.tok_emb.embedding_dim, len(model.blocks), batch * block
    return 6 * params * tokens + 12 * layers * d_model * block * tokens


@pytest.mark.parametrize("sizes", [dict(d_model=128, n_layers=2, n_heads=4, block_size=128),  # experiment=charlm
                                   dict(d_model=96, n_layers=3, n_heads=6, block_size=64)])
def test_charlm_flops_match_the_hand_count(sizes: dict) -> None:
    torch.manual_seed(0)
    model = CharTransformer(**sizes)
    tokens = torch.randint(0, 256, (4, sizes["block_size"]))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    counted = count_flops(TaskModule(model, LanguageModelTask(), Precision()), (tokens, tokens))
    assert counted == pytest.approx(hand_count(model, 4, sizes["block_size"]), rel=0.05)
    # Counted on the meta device: the real model, its gradients and the random numbers are untouched.
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_the_meta_twin_keeps_tied_weights_and_drops_hooks() -> None:
    model = CharTransformer(tie_weights=True)
    model.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(AssertionError("a hook came along")))
    twin = meta_twin(model)
    assert twin.head.weight is twin.tok_emb.weight and twin.head.weight.device.type == "meta"
    twin(torch.zeros(2, 8, dtype=torch.long, device="meta"))
    assert model.head.weight.device.type == "cpu"


@pytest.mark.parametrize(("name", "kind", "expected"), [
    ("NVIDIA H200", "bf16", ("H200 SXM", 989.5)),
    ("NVIDIA H200 NVL", "bf16", ("H200 NVL", 835.5)),
    ("NVIDIA H100 80GB HBM3", "tf32", ("H100 SXM", 494.5)),
    ("NVIDIA H100 PCIe", "fp16", ("H100 PCIe", 756.5)),
    ("NVIDIA A100-SXM4-80GB", "tf32", ("A100", 156.0)),
    ("NVIDIA L40S", "bf16", ("L40S", 362.05)),
    ("NVIDIA L4", "fp32", ("L4", 30.3)),
    ("NVIDIA GeForce RTX 4090", "bf16", ("RTX 4090", 165.2)),
    ("NVIDIA A10G", "bf16", None),  # no datasheet: not guessed
    ("Tesla V100-SXM2-32GB", "bf16", None),  # no bfloat16 units
    ("Some Future GPU", "bf16", None),
])
def test_peak_table_by_device_name(name: str, kind: str, expected: tuple | None) -> None:
    assert peak_tflops(name, kind) == expected


def test_the_peak_follows_the_precision_and_tf32() -> None:
    before = tf32_settings()
    try:
        set_tf32_settings(("high", True))
        assert precision_kind("32-true", torch.device("cuda", 0)) == "tf32"
        assert precision_kind("32-true", torch.device("cpu")) == "fp32"
        set_tf32_settings(("highest", False))
        assert precision_kind("32-true", torch.device("cuda", 0)) == "fp32"
        assert precision_kind("bf16-mixed", torch.device("cuda", 0)) == "bf16"
        assert precision_kind("16-true", torch.device("cuda", 0)) == "fp16"
        assert precision_kind("64-true", torch.device("cuda", 0)) is None
    finally:
        set_tf32_settings(before)


def test_a_cpu_run_logs_the_flop_rate_and_mfu_only_with_a_peak(make_cfg: MakeCfg, tmp_path: Path) -> None:
    plain = runner.fit(make_cfg(), run_dir=tmp_path / "plain")
    assert plain["throughput/tflops_per_s"] > 0 and "throughput/mfu" not in plain
    assert json.loads((tmp_path / "plain" / "metrics.json").read_text())["throughput/tflops_per_s"] > 0
    model = build.build_model(make_cfg())
    batch = (torch.zeros(16, 8), torch.zeros(16, dtype=torch.long))
    per_sample = count_flops(TaskModule(model, build.build_task(make_cfg()), Precision()), batch) / 16
    assert plain["throughput/tflops_per_s"] == pytest.approx(per_sample * plain["throughput/samples_per_s"] / 1e12)
    peaked = runner.fit(make_cfg("trainer.peak_tflops=0.5"), run_dir=tmp_path / "peak")
    assert peaked["throughput/mfu"] == pytest.approx(peaked["throughput/tflops_per_s"] / 0.5)


def test_counting_changes_nothing_the_run_trains(make_cfg: MakeCfg, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    counted = runner.fit(make_cfg(), run_dir=tmp_path / "counted")
    monkeypatch.setattr(StepFlops, "count", lambda self, window, step: step() or 0.0)
    uncounted = runner.fit(make_cfg(), run_dir=tmp_path / "uncounted")
    assert "throughput/tflops_per_s" not in uncounted
    for key in ("train/loss", "val/loss", "val/acc"):
        assert counted[key] == uncounted[key]


def test_a_model_the_meta_device_cannot_run_is_counted_on_its_first_step(make_cfg: MakeCfg, tmp_path: Path) -> None:
    """A model that reads a tensor's value (.item(), as HuggingFace's GPT-2 does) fails on the meta device: its FLOPs
    are counted on the first step's own tensors (two micro-batches), the count on real tensors gives, and the run
    trains what a run without the count trains."""
    overrides = ("model._target_=reliability_models.ReadsValues", "trainer.accumulate_grad_batches=2")
    counted = runner.fit(make_cfg(*overrides), run_dir=tmp_path / "counted")
    model = build.build_model(make_cfg(*overrides))
    batch = (torch.zeros(16, 8), torch.zeros(16, dtype=torch.long))
    per_sample = count_flops(TaskModule(model, build.build_task(make_cfg()), Precision()), batch, on_meta=False) / 16
    assert counted["throughput/tflops_per_s"] == pytest.approx(per_sample * counted["throughput/samples_per_s"] / 1e12)
    assert "counted on the first step's own tensors" in (tmp_path / "counted" / "runner.log").read_text()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepFlops, "count", lambda self, window, step: step() or 0.0)
        uncounted = runner.fit(make_cfg(*overrides), run_dir=tmp_path / "uncounted")
    assert counted["train/loss"] == uncounted["train/loss"] and counted["val/loss"] == uncounted["val/loss"]


def test_fsdp_and_compiled_runs_count_what_the_plain_run_counts(make_cfg: MakeCfg, tmp_path: Path) -> None:
    per_sample = {}
    runs = {"plain": (), "fsdp": ("strategy=fsdp",), "compiled": ("trainer.compile={backend:eager}",)}
    for name, overrides in runs.items():
        metrics = runner.fit(make_cfg(*overrides), run_dir=tmp_path / name)
        per_sample[name] = metrics["throughput/tflops_per_s"] / metrics["throughput/samples_per_s"]
    assert per_sample["fsdp"] == pytest.approx(per_sample["plain"])
    assert per_sample["compiled"] == pytest.approx(per_sample["plain"])


def test_peak_tflops_must_be_positive(make_cfg: MakeCfg) -> None:
    with pytest.raises(ConfigError, match=r"trainer.peak_tflops=-1.0 must be a positive number"):
        validate(make_cfg("trainer.peak_tflops=-1"))


# -- fused optimizers ---------------------------------------------------------------------------------------------

def optimizer_node(target: str, **settings: object) -> DictConfig:
    return OmegaConf.create({"_target_": target, "_partial_": True, "lr": 0.1, **settings})


@pytest.mark.parametrize(("target", "settings", "devices", "expected"), [
    ("torch.optim.AdamW", {}, {"cuda"}, {"fused": True}),
    ("torch.optim.Adam", {}, {"cuda"}, {"fused": True}),
    ("torch.optim.SGD", {"momentum": 0.9}, {"cuda"}, {"fused": True}),
    ("torch.optim.AdamW", {}, {"cpu"}, {}),
    ("torch.optim.AdamW", {}, {"cuda", "cpu"}, {}),  # a parameter left on the CPU: fused refuses the mix
    ("torch.optim.AdamW", {"foreach": True}, {"cuda"}, {}),  # the user's choice stands
    ("torch.optim.AdamW", {"fused": False}, {"cuda"}, {}),
    ("torch.optim.AdamW", {"differentiable": True}, {"cuda"}, {}),
    ("torch.optim.RMSprop", {}, {"cuda"}, {}),
])
def test_fused_is_chosen_only_on_cuda_and_only_when_the_user_did_not(target: str, settings: dict, devices: set,
                                                                      expected: dict) -> None:
    assert build.fused_setting(optimizer_node(target, **settings), devices) == expected


def test_the_optimizer_gets_fused_when_the_decision_says_cuda(make_cfg: MakeCfg,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_cfg("optimizer=adamw")
    model = torch.nn.Linear(2, 2)
    assert build.build_optimizer(cfg, model.parameters()).defaults["fused"] is None  # CPU: torch's default
    seen = []
    monkeypatch.setattr(build, "fused_setting", lambda node, devices: seen.append(devices) or {"fused": False})
    optimizer = build.build_optimizer(cfg, [{"params": list(model.parameters())}])
    assert seen == [{"cpu"}] and optimizer.defaults["fused"] is False  # the decision's kwargs reach the optimizer


# -- TF32 ---------------------------------------------------------------------------------------------------------

def test_tf32_is_set_for_32_true_on_cuda_only_and_put_back_at_teardown() -> None:
    before = tf32_settings()
    on, off = Precision(), Precision(tf32=False)
    on.setup(torch.device("cpu"))
    assert tf32_settings() == before  # the CPU's matmuls are not touched
    on.setup(torch.device("cuda", 0))
    assert tf32_settings() == ("high", True)
    on.teardown()
    off.setup(torch.device("cuda", 0))
    assert tf32_settings() == ("highest", False)
    off.teardown()
    assert tf32_settings() == before
    mixed = MixedPrecision("bf16-mixed", device="cpu")
    mixed.setup(torch.device("cuda", 0))
    assert tf32_settings() == before  # autocast picks the dtype of its matmuls itself


def test_tf32_composes_and_validates(make_cfg: MakeCfg) -> None:
    assert make_cfg().precision.tf32 is True
    assert build.build_precision(make_cfg("precision.tf32=false"), None).tf32 is False
    with pytest.raises(Exception, match="precision.tf32"):
        make_cfg("precision.tf32=sometimes")
    with pytest.raises(ValueError, match="precision.tf32='yes' must be true or false"):
        Precision(tf32="yes")  # type: ignore[arg-type]
