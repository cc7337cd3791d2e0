"""Tests for the precision plugins: dtypes end to end, default-dtype hygiene, loss scaling and its state."""

from __future__ import annotations

import threading
from collections import OrderedDict, namedtuple
from collections.abc import Callable

import pytest
import torch
from torch import nn

from runner.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# name -> (factory on CPU, parameter dtype, forward output dtype)
CPU_CASES: dict[str, tuple[Callable[[], Precision], torch.dtype, torch.dtype]] = {
    "32-true": (Precision, torch.float32, torch.float32),
    "64-true": (DoublePrecision, torch.float64, torch.float64),
    "16-mixed": (lambda: MixedPrecision("16-mixed", device="cpu"), torch.float32, torch.float16),
    "bf16-mixed": (lambda: MixedPrecision("bf16-mixed", device="cpu"), torch.float32, torch.bfloat16),
    "16-true": (lambda: HalfPrecision("16-true"), torch.float16, torch.float16),
    "bf16-true": (lambda: HalfPrecision("bf16-true"), torch.bfloat16, torch.bfloat16),
}

Batch = namedtuple("Batch", ["inputs", "targets"])


@pytest.fixture(autouse=True)
def _default_dtype_untouched():
    assert torch.get_default_dtype() == torch.float32
    yield
    leaked = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    assert leaked == torch.float32, f"test left the default dtype at {leaked}"


def build(precision: Precision, in_features: int = 4, out_features: int = 3) -> nn.Linear:
    torch.manual_seed(0)
    with precision.module_init_context():
        module = nn.Linear(in_features, out_features)
    return precision.convert_module(module)


def train_step(precision: Precision, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    torch.manual_seed(1)
    inputs = precision.convert_input(torch.randn(8, model.in_features))
    with precision.forward_context():
        out = model(inputs)
    loss = precision.convert_output(out).pow(2).mean()
    precision.backward(loss)
    precision.optimizer_step(optimizer)
    optimizer.zero_grad()
    return out


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_dtypes_through_a_training_step(name: str) -> None:
    factory, param_dtype, out_dtype = CPU_CASES[name]
    precision = factory()
    assert precision.precision == name
    model = build(precision)
    assert model.weight.dtype == param_dtype and model.bias.dtype == param_dtype
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    out = train_step(precision, model, optimizer)

    assert out.dtype == out_dtype
    # Losses take float32 outputs, except under 64-true, whose losses and gradients stay float64 end to end.
    assert precision.convert_output(out).dtype == (torch.float64 if name == "64-true" else torch.float32)
    assert not torch.equal(model.weight.detach(), before), "optimizer_step left the weights unchanged"
    assert model.weight.dtype == param_dtype
    precision.teardown()


@pytest.mark.parametrize("name", [n for n in CPU_CASES if n not in ("32-true", "64-true")])
def test_convert_output_gives_float32(name: str) -> None:
    precision = CPU_CASES[name][0]()
    out = {"logits": torch.randn(2, 3, dtype=CPU_CASES[name][2]), "index": torch.tensor([1, 2])}
    converted = precision.convert_output(out)
    assert converted["logits"].dtype == torch.float32
    assert converted["index"] is out["index"]


def test_64_true_keeps_the_outputs_in_float64() -> None:
    """A cast to float32 before the loss would round every gradient to 7 digits: 64-true keeps them."""
    out = {"logits": torch.randn(2, 3, dtype=torch.float64)}
    assert DoublePrecision().convert_output(out) is out


def test_32_true_leaves_everything_alone() -> None:
    precision = Precision()
    data = {"x": torch.randn(2, dtype=torch.float64)}
    assert precision.convert_input(data) is data
    assert precision.convert_output(data) is data
    module = nn.Linear(2, 2).double()
    assert precision.convert_module(module).weight.dtype == torch.float64


@pytest.mark.parametrize(
    "factory,dtype",
    [
        (DoublePrecision, torch.float64),
        (lambda: HalfPrecision("16-true"), torch.float16),
        (lambda: HalfPrecision("bf16-true"), torch.bfloat16),
    ],
)
def test_module_init_context_sets_and_restores_default_dtype(factory, dtype) -> None:
    precision = factory()
    with precision.module_init_context():
        assert torch.get_default_dtype() == dtype
    assert torch.get_default_dtype() == torch.float32

    with pytest.raises(RuntimeError, match="model constructor failed"):
        with precision.module_init_context():
            raise RuntimeError("model constructor failed")
    assert torch.get_default_dtype() == torch.float32


def test_module_init_context_restores_a_non_default_previous_dtype() -> None:
    torch.set_default_dtype(torch.float64)
    try:
        with HalfPrecision("bf16-true").module_init_context():
            assert torch.get_default_dtype() == torch.bfloat16
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)


def test_teardown_restores_dtype_of_a_context_left_open() -> None:
    precision = DoublePrecision()
    context = precision.module_init_context()
    context.__enter__()
    assert torch.get_default_dtype() == torch.float64
    precision.teardown()
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("factory", [Precision, lambda: MixedPrecision("bf16-mixed", device="cpu")])
def test_module_init_context_leaves_default_dtype_without_a_cast(factory) -> None:
    with factory().module_init_context():
        assert torch.get_default_dtype() == torch.float32


def test_convert_input_keeps_containers_and_integer_tensors() -> None:
    precision = HalfPrecision("bf16-true")
    labels = torch.tensor([0, 2, 1])
    data = {
        "pair": (torch.randn(3, 2), labels),
        "list": [torch.randn(1), "text", 3.5],
        "batch": Batch(torch.randn(3, 2), labels),
        "ordered": OrderedDict(x=torch.randn(2)),
    }
    out = precision.convert_input(data)

    assert type(out) is dict and set(out) == set(data)
    assert type(out["pair"]) is tuple and out["pair"][0].dtype == torch.bfloat16
    assert out["pair"][1] is labels
    assert type(out["list"]) is list and out["list"][0].dtype == torch.bfloat16
    assert out["list"][1:] == ["text", 3.5]
    assert type(out["batch"]) is Batch and out["batch"].inputs.dtype == torch.bfloat16
    assert out["batch"].targets is labels
    assert type(out["ordered"]) is OrderedDict and out["ordered"]["x"].dtype == torch.bfloat16
    assert data["pair"][0].dtype == torch.float32, "convert_input changed the caller's batch in place"


@pytest.mark.parametrize("name", ["16-mixed", "bf16-mixed"])
def test_mixed_leaves_inputs_alone(name: str) -> None:
    batch = (torch.randn(2, 2), torch.tensor([1, 0]))
    assert MixedPrecision(name, device="cpu").convert_input(batch) is batch


def test_double_casts_inputs_to_float64() -> None:
    inputs, labels = DoublePrecision().convert_input([torch.randn(2), torch.tensor([1])])
    assert inputs.dtype == torch.float64 and labels.dtype == torch.int64


def test_forward_context_is_fresh_and_works_in_threads() -> None:
    precision = MixedPrecision("bf16-mixed", device="cpu")
    assert precision.forward_context() is not precision.forward_context()
    model = nn.Linear(4, 2)
    dtypes: list[torch.dtype] = []

    def replica() -> None:
        with precision.forward_context():
            dtypes.append(model(torch.randn(2, 4)).dtype)

    threads = [threading.Thread(target=replica) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert dtypes == [torch.bfloat16] * 3
    assert model(torch.randn(2, 4)).dtype == torch.float32, "autocast leaked out of the context"


def scaled_setup(init_scale: float = 1024.0) -> tuple[MixedPrecision, nn.Linear, torch.optim.SGD]:
    precision = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))
    model = build(precision)
    return precision, model, torch.optim.SGD(model.parameters(), lr=0.1)


def backward_once(precision: Precision, model: nn.Linear) -> None:
    torch.manual_seed(1)
    with precision.forward_context():
        out = model(precision.convert_input(torch.randn(8, 4)))
    precision.backward(precision.convert_output(out).pow(2).mean())


def test_16_mixed_creates_an_enabled_scaler_and_bf16_has_none() -> None:
    assert MixedPrecision("16-mixed", device="cpu").scaler.is_enabled()
    bf16 = MixedPrecision("bf16-mixed", device="cpu")
    assert not bf16.scaler.is_enabled()
    assert bf16.state_dict() == {}


def test_inf_gradient_skips_the_step_and_lowers_the_scale() -> None:
    precision, model, optimizer = scaled_setup(init_scale=1024.0)
    backward_once(precision, model)
    model.weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]

    precision.optimizer_step(optimizer)

    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert precision.scaler.get_scale() == 512.0


def test_unscale_then_clip_then_step() -> None:
    reference = build(Precision())
    with torch.autocast("cpu", dtype=torch.float16):
        torch.manual_seed(1)
        out = reference(torch.randn(8, 4))
    out.float().pow(2).mean().backward()

    precision, model, optimizer = scaled_setup(init_scale=1024.0)
    backward_once(precision, model)
    assert torch.allclose(model.weight.grad, reference.weight.grad * 1024.0, rtol=1e-3)
    precision.unscale_gradients(optimizer)
    precision.unscale_gradients(optimizer)  # a second call in the same step must not unscale again
    assert torch.allclose(model.weight.grad, reference.weight.grad, rtol=1e-3)

    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    grads = [p.grad.detach().clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    precision.optimizer_step(optimizer)

    for param, old, grad in zip(model.parameters(), before, grads):
        assert torch.allclose(param.detach(), old - 0.1 * grad), "step did not use the unscaled, clipped gradient"
    # The next step unscales again rather than treating the optimizer as already done.
    optimizer.zero_grad()
    backward_once(precision, model)
    precision.unscale_gradients(optimizer)
    assert model.weight.grad.abs().max() < 100.0


def test_scaler_state_round_trips_through_weights_only_load(tmp_path) -> None:
    precision, model, optimizer = scaled_setup(init_scale=1024.0)
    backward_once(precision, model)
    model.weight.grad[0, 0] = float("nan")
    precision.optimizer_step(optimizer)
    assert precision.scaler.get_scale() == 512.0

    path = tmp_path / "precision.pt"
    torch.save(precision.state_dict(), path)
    state = torch.load(path, weights_only=True)

    restored = MixedPrecision("16-mixed", device="cpu")
    restored.load_state_dict(state)
    assert restored.scaler.get_scale() == 512.0
    assert restored.state_dict() == precision.state_dict()


def test_empty_state_is_a_no_op() -> None:
    precision = MixedPrecision("16-mixed", device="cpu")
    precision.load_state_dict({})
    assert precision.scaler.get_scale() == 65536.0
    for plain in (Precision(), DoublePrecision(), HalfPrecision("16-true")):
        assert plain.state_dict() == {}
        plain.load_state_dict({})


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: HalfPrecision("16-mixed"), "'16-mixed'"),
        (lambda: HalfPrecision("fp16"), "'fp16'"),
        (lambda: MixedPrecision("16-true", device="cpu"), "'16-true'"),
        (lambda: MixedPrecision("bf16", device="cpu"), "'bf16'"),
        (lambda: MixedPrecision("16-mixed", device="tpu"), "'tpu'"),
    ],
)
def test_bad_values_name_the_value_and_the_allowed_ones(make, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as error:
        make()
    assert "allowed" in str(error.value)


def test_bf16_mixed_rejects_a_scaler() -> None:
    with pytest.raises(ValueError, match="bf16-mixed"):
        MixedPrecision("bf16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name,dtype", [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_mixed_on_cuda(name: str, dtype: torch.dtype) -> None:
    precision = MixedPrecision(name)
    assert precision.device == "cuda"
    model = build(precision).cuda()
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with precision.forward_context():
        out = model(torch.randn(8, 4, device="cuda"))
    assert out.dtype == dtype
    precision.backward(precision.convert_output(out).pow(2).mean())
    precision.unscale_gradients(optimizer)
    precision.optimizer_step(optimizer)
    assert not torch.equal(model.weight.detach(), before)
    assert (precision.state_dict() != {}) == (name == "16-mixed")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name,dtype", [("16-true", torch.float16), ("bf16-true", torch.bfloat16)])
def test_half_on_cuda(name: str, dtype: torch.dtype) -> None:
    precision = HalfPrecision(name)
    model = build(precision).cuda()
    out = model(precision.convert_input(torch.randn(8, 4, device="cuda")))
    assert out.dtype == dtype and precision.convert_output(out).dtype == torch.float32
