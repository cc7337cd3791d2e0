"""Tests for the checkpoint IO plugins: atomic writes, clear load errors, background saves."""

from __future__ import annotations

import collections
import os
import subprocess
import threading
import time

import pytest
import torch

from runner.checkpoint_io import AsyncCheckpointIO, CheckpointError, CheckpointIO, TorchCheckpointIO
from runner.checkpoint_io import torch_io
from runner.checkpoint_io.torch_io import CHECKSUM_KEY


class NotAllowed:
    """A class torch.load(weights_only=True) must refuse."""


class SlowIO(CheckpointIO):
    """Delegates to TorchCheckpointIO after sleeping, so a background write is observable."""

    def __init__(self, delays: list[float] | None = None) -> None:
        self.inner = TorchCheckpointIO()
        self.delays = list(delays or [])
        self.torn_down = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        time.sleep(self.delays.pop(0) if self.delays else 0.2)
        self.inner.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path, map_location="cpu"):
        return self.inner.load_checkpoint(path, map_location)

    def remove_checkpoint(self, path):
        self.inner.remove_checkpoint(path)

    def teardown(self):
        self.torn_down += 1


class FailingIO(SlowIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        raise OSError(28, "No space left on device")


def _checkpoint(value: float = 1.0) -> dict:
    return {
        "model": {"w": torch.full((3, 2), value), "b": torch.arange(4, dtype=torch.int64)},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(2) * value}}, "param_groups": [{"lr": 0.1}]},
        "step": 7,
        "epoch": 2,
        "loss": 0.25,
        "name": "run-a",
        "history": [1, 2.5, "x"],
    }


def _assert_same(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value) and loaded[key].dtype == value.dtype
        elif isinstance(value, dict):
            _assert_same(loaded[key], value)
        else:
            assert loaded[key] == value


def test_round_trip_creates_parents_and_loads_weights_only(tmp_path):
    path = tmp_path / "checkpoints" / "nested" / "last.ckpt"
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(), path)
    _assert_same(io.load_checkpoint(path), _checkpoint())
    plain = torch.load(path, weights_only=True)  # what a user's own script sees: the state and its checksum
    assert isinstance(plain.pop(CHECKSUM_KEY), int)
    _assert_same(plain, _checkpoint())
    assert os.listdir(path.parent) == ["last.ckpt"]


def test_a_flipped_byte_in_a_tensor_is_refused_and_an_older_file_without_checksum_loads(tmp_path):
    path = tmp_path / "last.ckpt"
    io = TorchCheckpointIO()
    state = _checkpoint(1.0)
    state["model"]["w"] = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 0.5
    io.save_checkpoint(state, path)
    data = bytearray(path.read_bytes())
    at = data.find(state["model"]["w"].numpy().tobytes())
    assert at > 0
    data[at + 9] ^= 0x01  # one bit of one weight: torch loads the file without complaint
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path, weights_only=True)["model"]["w"], state["model"]["w"])
    with pytest.raises(CheckpointError, match="do not match the checksum"):
        io.load_checkpoint(path)
    torch.save(_checkpoint(), tmp_path / "plain.ckpt")  # written by torch.save alone: nothing to check
    _assert_same(io.load_checkpoint(tmp_path / "plain.ckpt"), _checkpoint())


def test_a_full_disk_is_named_and_the_previous_checkpoint_stays(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        io = TorchCheckpointIO()
        io.save_checkpoint(_checkpoint(2.0), mount / "last.ckpt")
        with pytest.raises(CheckpointError, match=r"the disk is full or a quota was reached \(0\.\d MiB free"):
            io.save_checkpoint({"model": {"w": torch.zeros(200_000)}}, mount / "last.ckpt")
        _assert_same(io.load_checkpoint(mount / "last.ckpt"), _checkpoint(2.0))
        assert os.listdir(mount) == ["last.ckpt"]
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_save_accepts_str_path_and_replaces_previous_file(tmp_path):
    path = str(tmp_path / "last.ckpt")
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(1.0), path)
    io.save_checkpoint(_checkpoint(5.0), path)
    _assert_same(io.load_checkpoint(path), _checkpoint(5.0))
    assert os.listdir(tmp_path) == ["last.ckpt"]


def _partial_save(obj, f):
    f.write(b"PK\x03\x04 half a zip")
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("how", ["disk full midway", "unpicklable value"])
def test_failed_save_keeps_previous_file_and_leaves_no_temp(tmp_path, monkeypatch, how):
    path = tmp_path / "last.ckpt"
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(1.0), path)
    bad = _checkpoint(2.0)
    if how == "disk full midway":
        monkeypatch.setattr(torch_io.torch, "save", _partial_save)
    else:
        bad["fn"] = lambda: 0
    with pytest.raises(CheckpointError) as info:
        io.save_checkpoint(bad, path)
    monkeypatch.undo()
    message = str(info.value)
    assert message.startswith(f"cannot write checkpoint {path}: ")
    assert message.endswith("; the previous file is left intact")
    if how == "disk full midway":
        assert "No space left on device" in message
    _assert_same(io.load_checkpoint(path), _checkpoint(1.0))
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_failed_replace_removes_the_complete_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(1.0), path)

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", dst)

    with monkeypatch.context() as patch:
        patch.setattr(torch_io.os, "replace", refuse)
        with pytest.raises(CheckpointError, match="Permission denied"):
            io.save_checkpoint(_checkpoint(2.0), path)
    _assert_same(io.load_checkpoint(path), _checkpoint(1.0))
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_read_only_directory_gives_checkpoint_error(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    path = directory / "last.ckpt"
    TorchCheckpointIO().save_checkpoint(_checkpoint(1.0), path)
    directory.chmod(0o500)
    try:
        if os.access(directory, os.W_OK):
            pytest.skip("chmod does not stop this user from writing (running as root)")
        with pytest.raises(CheckpointError) as info:
            TorchCheckpointIO().save_checkpoint(_checkpoint(2.0), path)
        assert str(path) in str(info.value) and "Permission denied" in str(info.value)
        assert os.listdir(directory) == ["last.ckpt"]
        _assert_same(TorchCheckpointIO().load_checkpoint(path), _checkpoint(1.0))
    finally:
        directory.chmod(0o700)


def test_parent_that_is_a_file_gives_checkpoint_error(tmp_path):
    blocker = tmp_path / "checkpoints"
    blocker.write_bytes(b"not a directory")
    path = blocker / "last.ckpt"
    with pytest.raises(CheckpointError) as info:
        TorchCheckpointIO().save_checkpoint(_checkpoint(), path)
    assert str(info.value).startswith(f"cannot write checkpoint {path}: ")
    assert blocker.read_bytes() == b"not a directory"
    assert os.listdir(tmp_path) == ["checkpoints"]


def test_target_that_is_a_directory_gives_checkpoint_error(tmp_path):
    path = tmp_path / "last.ckpt"
    path.mkdir()
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        TorchCheckpointIO().save_checkpoint(_checkpoint(), path)
    assert path.is_dir() and os.listdir(path) == [] and os.listdir(tmp_path) == ["last.ckpt"]


def test_missing_file(tmp_path):
    path = tmp_path / "nope.ckpt"
    with pytest.raises(CheckpointError) as info:
        TorchCheckpointIO().load_checkpoint(path)
    assert str(info.value) == f"checkpoint not found: {path}"


@pytest.mark.parametrize("damage", ["random bytes", "truncated", "empty", "text", "flipped name"])
def test_corrupt_file(tmp_path, damage):
    path = tmp_path / "last.ckpt"
    TorchCheckpointIO().save_checkpoint(_checkpoint(), path)
    good = path.read_bytes()
    damaged = {
        "random bytes": torch.randint(0, 256, (512,), dtype=torch.uint8).numpy().tobytes(),
        "truncated": good[: len(good) // 2],
        "empty": b"",
        "text": b"not a checkpoint\n" * 10,
        # One flipped bit in the name of a class the pickle needs: a global that does not exist.
        "flipped name": good.replace(b"OrderedDict", b"OrderedDicu", 1),
    }[damage]
    assert damaged != good
    path.write_bytes(damaged)
    with pytest.raises(CheckpointError) as info:
        TorchCheckpointIO().load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"cannot load checkpoint {path}: ")
    # Not "must hold only tensors": the bytes are bad, not what was saved.
    assert message.endswith("; the file is damaged, truncated or not a checkpoint; use an earlier checkpoint")
    assert "\n" not in message and len(message) < 400
    assert message.split(": ", 1)[1].split(";")[0].strip()  # a reason is given


def test_random_bytes_are_named_damaged_whatever_they_are(tmp_path):
    """200 files of random bytes: the unpickler fails in many ways (a stack underflow, a memo past its end, a name
    that is no UTF-8), each a damaged file, never a checkpoint holding objects that are not data."""
    path = tmp_path / "last.ckpt"
    for seed in range(200):
        generator = torch.Generator().manual_seed(seed)
        path.write_bytes(torch.randint(0, 256, (512,), dtype=torch.uint8, generator=generator).numpy().tobytes())
        with pytest.raises(CheckpointError) as info:
            TorchCheckpointIO().load_checkpoint(path)
        assert str(info.value).endswith("the file is damaged, truncated or not a checkpoint; use an earlier "
                                        "checkpoint"), (seed, str(info.value))


def test_custom_class_is_refused(tmp_path):
    path = tmp_path / "last.ckpt"
    TorchCheckpointIO().save_checkpoint({"model": {}, "extra": NotAllowed()}, path)
    with pytest.raises(CheckpointError) as info:
        TorchCheckpointIO().load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"cannot load checkpoint {path}: ")
    assert "NotAllowed" in message and "checkpoints must hold only tensors" in message
    assert "\n" not in message and "\x1b" not in message


def test_file_without_a_dict_is_refused(tmp_path):
    path = tmp_path / "tensor.pt"
    torch.save(torch.ones(2), path)
    with pytest.raises(CheckpointError, match="holds a Tensor"):
        TorchCheckpointIO().load_checkpoint(path)


def test_storage_options_are_refused(tmp_path):
    with pytest.raises(TypeError, match="storage_options"):
        TorchCheckpointIO().save_checkpoint(_checkpoint(), tmp_path / "x.ckpt", storage_options={"a": 1})
    assert os.listdir(tmp_path) == []


def test_remove(tmp_path):
    path = tmp_path / "last.ckpt"
    io = TorchCheckpointIO()
    io.save_checkpoint(_checkpoint(), path)
    io.remove_checkpoint(path)
    assert not path.exists()
    io.remove_checkpoint(path)  # removing what is gone is not an error


def test_async_saves_values_at_call_time(tmp_path):
    path = tmp_path / "last.ckpt"
    param = torch.nn.Parameter(torch.zeros(3))
    state = {"model": {"w": param}, "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}}}
    io = AsyncCheckpointIO(SlowIO())
    io.save_checkpoint(state, path)
    with torch.no_grad():
        param.add_(1)
    state["optimizer"]["state"][0]["exp_avg"].add_(1)
    state["model"]["extra"] = torch.ones(1)
    io.teardown()
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["model"]["w"], torch.zeros(3))
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], torch.zeros(3))
    assert "extra" not in loaded["model"]
    assert not loaded["model"]["w"].requires_grad


def test_async_writes_in_background_and_in_call_order(tmp_path):
    path = tmp_path / "last.ckpt"
    # The first write is slower, so a second writer thread would finish first and lose the order.
    io = AsyncCheckpointIO(SlowIO(delays=[0.3, 0.0]))
    start = time.monotonic()
    io.save_checkpoint({"v": torch.tensor(1)}, path)
    assert time.monotonic() - start < 0.15
    assert not path.exists()
    io.save_checkpoint({"v": torch.tensor(2)}, path)
    io.wait()
    assert torch.load(path, weights_only=True)["v"].item() == 2
    io.teardown()  # joins the worker thread: no earlier write may still land afterwards
    assert torch.load(path, weights_only=True)["v"].item() == 2


def test_async_load_and_remove_wait_for_pending_writes(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AsyncCheckpointIO(SlowIO())
    io.save_checkpoint(_checkpoint(3.0), path)
    _assert_same(io.load_checkpoint(path), _checkpoint(3.0))
    io.save_checkpoint(_checkpoint(4.0), path)
    io.remove_checkpoint(path)
    assert not path.exists()
    io.teardown()
    assert not path.exists()


def test_async_error_surfaces_at_next_save_and_at_teardown(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AsyncCheckpointIO(FailingIO())
    deadline = time.monotonic() + 5
    with pytest.raises(CheckpointError) as info:
        while time.monotonic() < deadline:  # each call submits a write that fails in the background
            io.save_checkpoint({"v": torch.tensor(1)}, path)
            time.sleep(0.01)
    assert str(path) in str(info.value) and "No space left on device" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)

    io.save_checkpoint({"v": torch.tensor(2)}, path)
    with pytest.raises(CheckpointError, match="No space left on device"):
        io.teardown()
    assert io.checkpoint_io.torn_down == 1
    io.teardown()  # a second teardown is harmless and has nothing left to report
    assert not path.exists()


def test_async_wait_reports_base_io_error(tmp_path):
    blocker = tmp_path / "checkpoints"
    blocker.write_bytes(b"")
    path = blocker / "last.ckpt"
    io = AsyncCheckpointIO()
    assert isinstance(io.checkpoint_io, TorchCheckpointIO)
    io.save_checkpoint(_checkpoint(), path)
    with pytest.raises(CheckpointError) as info:
        io.wait()
    assert f"cannot write checkpoint {path}" in str(info.value)
    assert isinstance(info.value.__cause__, CheckpointError)
    io.wait()  # the error is reported once
    io.teardown()


def test_async_copy_keeps_container_types_and_works_after_teardown(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AsyncCheckpointIO()
    io.teardown()
    state = {
        "model": collections.OrderedDict(w=torch.ones(2)),
        "shape": (2, 3),
        "lrs": [0.1, None],
        "flag": True,
    }
    io.save_checkpoint(state, path)
    loaded = io.load_checkpoint(path)
    io.teardown()
    assert isinstance(loaded["model"], collections.OrderedDict)
    assert loaded["shape"] == (2, 3) and loaded["lrs"] == [0.1, None] and loaded["flag"] is True
    assert threading.active_count() < 50  # no thread leaked per save


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_async_copies_cuda_tensors_to_cpu(tmp_path):
    path = tmp_path / "last.ckpt"
    weight = torch.zeros(1024, device="cuda")
    io = AsyncCheckpointIO(SlowIO())
    io.save_checkpoint({"model": {"w": weight}}, path)
    weight.add_(1)
    io.teardown()
    loaded = torch.load(path, weights_only=True)
    assert loaded["model"]["w"].device.type == "cpu"
    assert torch.equal(loaded["model"]["w"], torch.zeros(1024))


def test_metrics_json_is_written_only_once_the_async_checkpoint_of_its_step_is_on_disk(make_cfg, tmp_path,
                                                                                      monkeypatch):
    """A process killed right after metrics.json appears must not leave a last.ckpt of an earlier step."""
    import runner
    from runner.loop import results

    write = TorchCheckpointIO.save_checkpoint

    def slow_save(self, checkpoint, path, storage_options=None):
        time.sleep(0.3)  # the background write is still going when training ends
        write(self, checkpoint, path, storage_options)

    on_disk_at_write = []
    write_json = results._write_json

    def recording_write_json(path, data):
        if path.name == "metrics.json":
            last = tmp_path / "checkpoints" / "last.ckpt"
            on_disk_at_write.append(torch.load(last, weights_only=True)["step"] if last.exists() else None)
        write_json(path, data)

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", slow_save)
    monkeypatch.setattr(results, "_write_json", recording_write_json)
    metrics = runner.fit(make_cfg("checkpoint_io=async", "trainer.max_steps=6", "trainer.ckpt_every_n_steps=2"),
                         run_dir=tmp_path)
    assert metrics["step"] == 6 and on_disk_at_write == [6]


# -- sharded folders: optimizer state by parameter name ------------------------------------------------------

def _several_optimizers() -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    """An MLP trained by two optimizers, each over part of it: AdamW over the first layer (its bias in a group
    without decay), SGD with momentum over the rest; one step each."""
    from runner.checkpoint_io.optimizer_keys import record_names
    from runner.models import MLP

    torch.manual_seed(0)
    model = MLP(in_features=4, hidden=8, depth=2, num_classes=2)
    first = torch.optim.AdamW([{"params": [model.net[0].weight]},
                               {"params": [model.net[0].bias], "weight_decay": 0.0}], lr=0.1)
    rest = torch.optim.SGD([p for name, p in model.named_parameters() if not name.startswith("net.0.")], lr=0.1,
                           momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    first.step()
    rest.step()
    record_names([first, rest], model)
    return model, [first, rest]


def _sharded_round_trip(checkpoint: dict, folder) -> dict:
    from runner.checkpoint_io import sharded

    tensors, rest = sharded.split(checkpoint, [name for name in checkpoint["model"]])
    tmp = sharded.temporary_path(folder, "test")
    sharded.write(tensors, rest, tmp)
    sharded.publish(tmp, folder)
    return sharded.read(folder)


def test_several_optimizers_are_stored_by_parameter_name_and_read_back_as_saved(tmp_path):
    from runner.checkpoint_io.dcp_metadata import read_metadata

    model, optimizers = _several_optimizers()
    states = [optimizer.state_dict() for optimizer in optimizers]
    checkpoint = {"model": model.state_dict(), "step": 1,
                  "optimizer": {"state": {}, "param_groups": [g for s in states for g in s["param_groups"]],
                                "optimizers": states}}
    loaded = _sharded_round_trip(checkpoint, tmp_path / "last.ckpt")
    keys = {".".join(where) for where in read_metadata(tmp_path / "last.ckpt").planner_data.values()}
    assert {"optimizers.0.net.0.bias.exp_avg", "optimizers.1.net.2.weight.momentum_buffer"} <= keys
    for saved, read in zip(states, loaded["optimizer"]["optimizers"]):
        assert read["param_groups"] == saved["param_groups"] and read["state"].keys() == saved["state"].keys()
        for index, entries in saved["state"].items():
            for name, value in entries.items():
                assert torch.equal(read["state"][index][name], value), (index, name)
    for optimizer, state in zip(optimizers, loaded["optimizer"]["optimizers"]):
        optimizer.load_state_dict(state)  # what a resume does with each


def test_several_optimizers_without_names_are_refused_in_one_line(tmp_path):
    model, optimizers = _several_optimizers()
    states = [torch.optim.SGD(o.param_groups[0]["params"], lr=0.1).state_dict() for o in optimizers]  # unnamed
    with pytest.raises(CheckpointError, match=r"^cannot tell which parameter each optimizer state belongs to: 2 "
                                              r"optimizer\(s\)"):
        _sharded_round_trip({"model": model.state_dict(), "step": 1, "optimizer": {"optimizers": states}},
                            tmp_path / "last.ckpt")
