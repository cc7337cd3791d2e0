"""DataParallelStrategy: reduction of per-device values, batch placement, CPU behaviour and DataParallel on GPUs."""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from runner.checkpoint_io import TorchCheckpointIO
from runner.precision import MixedPrecision, Precision
from runner.strategies import DataParallelStrategy, SingleDeviceStrategy

Pair = namedtuple("Pair", ["x", "y"])

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class TinyTask(nn.Module):
    """The loop's task shape: forward(inputs, targets) returns 0-dim sums that add up across devices."""

    def __init__(self, precision: Precision | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.precision = precision or Precision()

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        with self.precision.forward_context():
            logits = self.net(inputs)
        loss_sum = nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
        return {
            "loss_sum": loss_sum,
            "count": torch.tensor(targets.numel(), device=targets.device),
            "correct": (logits.argmax(-1) == targets).sum(),
            "logits_dtype_is_bf16": torch.tensor(logits.dtype == torch.bfloat16, device=targets.device),
        }


def _batch(n: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def _task(seed: int = 0, precision: Precision | None = None) -> TinyTask:
    torch.manual_seed(seed)
    return TinyTask(precision)


# -- reduce and the identity collectives ------------------------------------------------------------
def test_reduce_averages_per_device_values() -> None:
    strategy = DataParallelStrategy()
    out = strategy.reduce(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert out.dim() == 0 and out.item() == pytest.approx(2.5)


def test_reduce_integer_tensor_gives_float_mean() -> None:
    out = DataParallelStrategy().reduce(torch.tensor([1, 2]))
    assert out.is_floating_point() and out.item() == pytest.approx(1.5)


def test_reduce_keeps_zero_dim_tensor() -> None:
    value = torch.tensor(7)
    assert DataParallelStrategy().reduce(value) is value


def test_reduce_dict_keeps_keys() -> None:
    out = DataParallelStrategy().reduce({"loss": torch.tensor([1.0, 2.0, 3.0, 4.0]), "acc": torch.tensor([0.5, 1.0])})
    assert list(out) == ["loss", "acc"]
    assert out["loss"].item() == pytest.approx(2.5) and out["acc"].item() == pytest.approx(0.75)


def test_reduce_nested_structure_and_non_tensors() -> None:
    collection = [
        (torch.tensor([2.0, 4.0]), 3, 0.25),
        {"name": "val", "inner": [torch.tensor([1.0, 2.0, 3.0])]},
        Pair(x=torch.tensor([0.0, 1.0]), y="y"),
    ]
    out = DataParallelStrategy().reduce(collection, "ignored", reduce_op="sum")
    assert type(out) is list and type(out[0]) is tuple and type(out[2]) is Pair
    assert out[0][0].item() == pytest.approx(3.0) and out[0][1:] == (3, 0.25)
    assert out[1]["name"] == "val" and out[1]["inner"][0].item() == pytest.approx(2.0)
    assert out[2].x.item() == pytest.approx(0.5) and out[2].y == "y"
    assert DataParallelStrategy().reduce(5) == 5 and DataParallelStrategy().reduce("s") == "s"


def test_all_reduce_broadcast_barrier_decision_pass_through() -> None:
    strategy = DataParallelStrategy()
    tensor = torch.tensor([1.0, 3.0])
    assert strategy.all_reduce(tensor) is tensor
    started = strategy.start_all_reduce(tensor, reduce_op="sum")
    tensor.add_(1.0)
    assert started().tolist() == [1.0, 3.0]  # a copy: what the caller does to its tensor later does not reach it
    obj = {"a": [1, 2]}
    assert strategy.broadcast(obj, src=0) is obj
    assert strategy.barrier("name") is None
    assert strategy.reduce_boolean_decision(torch.tensor(True)) is True
    assert strategy.reduce_boolean_decision(0, all=False) is False
    assert strategy.distributed_sampler_kwargs is None


# -- batch placement ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "batch",
    [
        (torch.ones(2), torch.zeros(2, dtype=torch.long)),
        [torch.ones(2), "label"],
        {"x": torch.ones(2), "meta": {"id": 3}},
        Pair(x=torch.ones(2), y=torch.zeros(1)),
        torch.ones(3),
    ],
    ids=["tuple", "list", "dict", "namedtuple", "tensor"],
)
def test_batch_to_device_keeps_types(batch: object) -> None:
    out = DataParallelStrategy().batch_to_device(batch, dataloader_idx=1)
    assert type(out) is type(batch)
    if isinstance(batch, torch.Tensor):
        assert out.device == torch.device("cpu") and torch.equal(out, batch)
    elif isinstance(batch, dict):
        assert out["meta"] == {"id": 3} and torch.equal(out["x"], batch["x"])
    else:
        assert torch.equal(out[0], batch[0])
        assert out[1] is batch[1] if isinstance(batch[1], str) else torch.equal(out[1], batch[1])


# -- construction ---------------------------------------------------------------------------------
def test_defaults_to_one_cpu_device() -> None:
    precision = Precision()
    strategy = DataParallelStrategy(precision_plugin=precision)
    assert strategy.root_device == torch.device("cpu")
    assert strategy.parallel_devices == [torch.device("cpu")]
    assert strategy.precision_plugin is precision and strategy.precision is precision
    assert isinstance(strategy.checkpoint_io, TorchCheckpointIO)


@pytest.mark.parametrize(
    "devices", [["cpu", "cpu"], [torch.device("cuda", 0), torch.device("cpu")]], ids=["two-cpu", "mixed"]
)
def test_refuses_several_non_cuda_devices(devices: list) -> None:
    with pytest.raises(ValueError, match="trainer.devices=2") as err:
        DataParallelStrategy(parallel_devices=devices)
    assert "strategy=ddp" in str(err.value) and "CUDA" in str(err.value)


# -- CPU: one device, same results as the single-device strategy ----------------------------------
def test_cpu_runs_module_unwrapped_like_single_device() -> None:
    strategy = DataParallelStrategy()
    task = _task()
    strategy.setup_environment()
    strategy.module_to_device(task)
    wrapped = strategy.setup_module(task)
    assert wrapped is task and strategy.unwrap(wrapped) is task and strategy.model is task

    inputs, targets = strategy.batch_to_device(_batch())
    out = strategy.training_step(wrapped, inputs, targets)
    direct = task(inputs, targets)
    assert out.keys() == direct.keys()
    for key in direct:
        assert torch.equal(out[key], direct[key]), key

    single = SingleDeviceStrategy("cpu")
    twin = _task()
    single_out = single.training_step(single.setup_module(twin), inputs, targets)
    assert torch.equal(out["loss_sum"], single_out["loss_sum"])
    loss = out["loss_sum"].sum() / out["count"].sum()
    assert loss.item() == pytest.approx(single_out["loss_sum"].item() / targets.numel())

    loss.backward()
    (single_out["loss_sum"] / targets.numel()).backward()
    for mine, theirs in zip(task.parameters(), twin.parameters()):
        assert torch.allclose(mine.grad, theirs.grad)


def test_validation_test_predict_steps_run_the_given_module() -> None:
    strategy = DataParallelStrategy()
    task = _task()
    inputs, targets = _batch()
    expected = task(inputs, targets)["loss_sum"]
    with torch.no_grad():
        for step in (strategy.validation_step, strategy.test_step, strategy.predict_step):
            assert torch.equal(step(task, inputs, targets)["loss_sum"], expected)


def test_setup_with_trainer_and_teardown_twice() -> None:
    strategy = DataParallelStrategy()
    strategy.teardown()  # before setup: nothing to move back
    task = _task()
    strategy.setup(SimpleNamespace(model=task))
    assert strategy.model is task
    assert next(task.parameters()).device == strategy.root_device
    strategy.teardown()
    strategy.teardown()
    assert next(task.parameters()).device == torch.device("cpu")


class RecordsMoves(TinyTask):
    """Records where `.to` sends it, since on a CPU-only machine every move looks the same."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[str] = []

    def to(self, *args, **kwargs):  # type: ignore[override]
        self.moves.append(str(torch.device(args[0])))
        return super().to(*args, **kwargs)


def test_teardown_moves_the_model_back_to_cpu() -> None:
    strategy = DataParallelStrategy()
    task = RecordsMoves()
    strategy.setup(SimpleNamespace(model=task))
    assert task.moves == ["cpu"]  # model_to_device, to the root device
    strategy.teardown()
    assert task.moves == ["cpu", "cpu"]


def test_model_to_device_without_model_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="setup"):
        DataParallelStrategy().model_to_device()


# -- GPU: DataParallel over every visible device --------------------------------------------------
def _cuda_strategy(precision: Precision | None = None) -> DataParallelStrategy:
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return DataParallelStrategy(parallel_devices=devices, precision_plugin=precision)


@pytest.mark.cuda
@needs_cuda
def test_cuda_gathered_loss_and_grads_match_one_device() -> None:
    strategy = _cuda_strategy()
    task, twin = _task(), _task()
    strategy.setup_environment()
    strategy.module_to_device(task)
    wrapped = strategy.setup_module(task)
    assert isinstance(wrapped, nn.DataParallel) and strategy.unwrap(wrapped) is task
    assert wrapped.device_ids == list(range(torch.cuda.device_count()))

    inputs, targets = strategy.batch_to_device(_batch(n=16))
    out = strategy.training_step(wrapped, inputs, targets)
    n_devices = len(strategy.parallel_devices)
    if n_devices > 1:
        assert out["loss_sum"].shape == (n_devices,) and out["count"].shape == (n_devices,)
    assert out["count"].sum().item() == 16
    loss = out["loss_sum"].sum() / out["count"].sum()

    twin.to(strategy.root_device)
    reference = twin(inputs, targets)["loss_sum"] / targets.numel()
    assert loss.item() == pytest.approx(reference.item(), abs=1e-5)
    loss.backward()
    reference.backward()
    for mine, theirs in zip(task.parameters(), twin.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)

    val = strategy.validation_step(wrapped, inputs, targets)
    assert val["count"].sum().item() == 16
    strategy.teardown()
    assert next(task.parameters()).device == torch.device("cpu")


@pytest.mark.cuda
@needs_cuda
def test_cuda_autocast_entered_inside_each_replica() -> None:
    precision = MixedPrecision("bf16-mixed", device="cuda")
    strategy = _cuda_strategy(precision)
    task = _task(precision=precision)
    strategy.module_to_device(task)
    wrapped = strategy.setup_module(task)
    inputs, targets = strategy.batch_to_device(_batch(n=8))
    with torch.no_grad():
        out = strategy.training_step(wrapped, inputs, targets)
    n_devices = len(strategy.parallel_devices)
    # One flag per replica, each computed inside that replica's thread.
    assert out["logits_dtype_is_bf16"].numel() == (n_devices if n_devices > 1 else 1)
    assert out["logits_dtype_is_bf16"].all()
    assert out["loss_sum"].dtype == torch.float32
