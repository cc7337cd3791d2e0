"""Checkpoints are data and are checked: no code runs from one, every file is verified against the checksums
written with it, impossible contents are refused, a run folder resumes from its own checkpoints whatever
strategy wrote them, and `last`/`best` never take another user's or another config's run."""

from __future__ import annotations

import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

import runner
from _dist import clean_environ, run_cli
from conftest import TINY, compose_config
from runner.checkpoint_io import CheckpointError, TorchCheckpointIO, manifest, sharded
from runner.checkpoint_io.torch_io import CHECKSUM_KEY
from runner.config import ConfigError
from runner.export import main as export_main
from runner.checks import validate
from runner.checkpoint_search import resolve_ckpt_path
from runner.strategies import SingleDeviceStrategy

SMALL = (*[o for o in TINY if not o.startswith("logger.")], "logger=none", "trainer.max_steps=2")


class Payload:
    """Pickled, it calls os.system when unpickled: what a hostile checkpoint holds."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def train(run_dir: Path, *overrides: str) -> dict:
    return runner.fit(compose_config([*SMALL, *overrides]), run_dir=run_dir)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("trained") / "run"
    train(run)
    return run


@pytest.fixture
def plain(trained: Path, tmp_path: Path) -> Path:
    """The checkpoint file of a 2-step run, in a copy of its run folder that the test may change."""
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run" / "checkpoints" / "last.ckpt"


def as_sharded(plain: Path, folder: Path) -> Path:
    """The same checkpoint as strategy=fsdp saves it (DCP shards, state.pt, checksums.json), in one process."""
    checkpoint = TorchCheckpointIO().load_checkpoint(plain)
    tensors, rest = sharded.split(checkpoint, list(checkpoint["model"]))  # an MLP: its parameters are its state
    tmp = sharded.temporary_path(folder, "test")
    sharded.write(tensors, rest, tmp)
    sharded.publish(tmp, folder)
    return folder


def resave(path: Path, edit) -> None:
    """Change a checkpoint file and write it with a matching checksum (as a tool of the user's would)."""
    checkpoint = TorchCheckpointIO().load_checkpoint(path)
    edit(checkpoint)
    TorchCheckpointIO().save_checkpoint(checkpoint, path)


def check(path: Path, *overrides: str) -> str:
    """The one line validate gives for resuming from `path` (with this config's tiny model)."""
    with pytest.raises(ConfigError) as info:
        validate(compose_config([*SMALL, f"trainer.ckpt_path={path}", *overrides]), str(path))
    assert len(info.value.problems) == 1, info.value.problems
    line = info.value.problems[0]
    assert "\n" not in line
    return line


def hostile_folder(folder: Path, marker: Path, plain: Path) -> Path:
    """A sharded checkpoint whose .metadata runs `touch marker`, with checksums.json made to match."""
    as_sharded(plain, folder)
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(f"touch {marker}")))
    manifest.write(folder)
    return folder


# -- no code from a checkpoint ------------------------------------------------------------------------

def test_the_metadata_of_a_real_sharded_checkpoint_reads_as_data(plain: Path, tmp_path: Path) -> None:
    folder = as_sharded(plain, tmp_path / "sharded.ckpt")
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "checksums.json", "state.pt"]
    loaded, original = sharded.read(folder), TorchCheckpointIO().load_checkpoint(plain)
    for key, tensor in original["model"].items():
        assert torch.equal(loaded["model"][key], tensor)
    assert loaded["step"] == 2


def test_a_metadata_payload_named_by_ckpt_path_never_runs(plain: Path, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    folder = hostile_folder(tmp_path / "evil.ckpt", marker, plain)
    result = run_cli([*SMALL, f"trainer.ckpt_path={folder}", "trainer.trust_unchecked_checkpoint=true",
                      f"hydra.run.dir={tmp_path / 'r1'}"], cwd=tmp_path)
    assert result.returncode == 1 and not marker.exists()
    assert f"{folder / '.metadata'} names posix.system, which DCP's metadata never holds" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_a_metadata_payload_in_another_run_found_by_last_never_runs(plain: Path, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    hostile_folder(plain, marker, Path(shutil.copy(plain, tmp_path / "copy.ckpt")))  # the run's last.ckpt, hostile
    result = run_cli([*SMALL, "trainer.ckpt_path=last", f"hydra.run.dir={tmp_path / 'new'}"], cwd=tmp_path)
    assert result.returncode == 1 and not marker.exists()
    output = result.stdout + result.stderr
    # The first line says which run it took; the error names the file and the refused global.
    assert output.splitlines()[0].endswith(f"trainer.ckpt_path=last: using {plain}, the newest last.ckpt of your "
                                           f"runs of this config under {tmp_path}")
    assert f"{plain / '.metadata'} names posix.system" in output and "Traceback" not in output


def test_export_refuses_a_metadata_payload(plain: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "PWNED"
    folder = hostile_folder(tmp_path / "evil.ckpt", marker, plain)
    assert export_main([str(folder), str(tmp_path / "weights.pt")]) == 1
    assert not marker.exists() and not (tmp_path / "weights.pt").exists()
    (line,) = capsys.readouterr().err.splitlines()
    assert "names posix.system" in line


def test_dcp_load_itself_reads_the_metadata_safely(plain: Path, tmp_path: Path) -> None:
    """The metadata DCP's load asks for comes from the safe reader too, not from its pickle.load."""
    marker = tmp_path / "PWNED"
    folder = hostile_folder(tmp_path / "evil.ckpt", marker, plain)
    from runner.checkpoint_io.dcp_metadata import safe_reader

    with pytest.raises(CheckpointError, match="names posix.system"):
        safe_reader(folder).read_metadata()
    with pytest.raises(CheckpointError, match="names posix.system"):
        SingleDeviceStrategy().load_checkpoint(folder, trust_unchecked=True)
    assert not marker.exists()


def test_metadata_that_points_outside_its_folder_or_calls_torch_is_refused(plain: Path, tmp_path: Path) -> None:
    from runner.checkpoint_io.dcp_metadata import read_metadata

    folder = as_sharded(plain, tmp_path / "sharded.ckpt")
    metadata = read_metadata(folder)
    next(iter(metadata.storage_data.values())).relative_path = "../../etc/passwd"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest.write(folder)
    assert "points at '../../etc/passwd', not a part of a shard file" in check(folder)

    class CallsTorch:
        def __reduce__(self):
            return (torch.load, (str(plain),))

    (folder / ".metadata").write_bytes(pickle.dumps(CallsTorch()))
    manifest.write(folder)
    assert "names torch.serialization.load, which DCP's metadata never holds" in check(folder)


def _evil_torch_file(path: Path) -> None:
    """A torch.save'd checkpoint whose pickle names `evilmod.Thing` (made here from a module object in memory)."""
    import types

    module = types.ModuleType("evilmod")
    exec("class Thing:\n    pass\n", module.__dict__)
    sys.modules["evilmod"] = module
    try:
        torch.save({"model": {}, "optimizer": {}, "step": 1, "x": module.Thing()}, path)
    finally:
        del sys.modules["evilmod"]


def test_a_file_naming_a_module_never_imports_it(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "IMPORTED"
    (tmp_path / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Thing:\n    pass\n")
    _evil_torch_file(tmp_path / "evil.pt")
    result = run_cli([*SMALL, "trainer.ckpt_path=evil.pt", "trainer.trust_unchecked_checkpoint=true",
                      f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path)
    assert result.returncode == 1 and not marker.exists()
    assert ("evil.pt: Unsupported global: GLOBAL evilmod.Thing was not an allowed global by default; checkpoints "
            "must hold only tensors, dicts, lists and numbers") in result.stderr
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # where `python -m runner.export` finds modules: the cwd first
    assert export_main(["evil.pt", "weights.pt", "--trust-unchecked"]) == 1
    assert not marker.exists() and "evilmod" not in sys.modules
    (line,) = capsys.readouterr().err.splitlines()
    assert "GLOBAL evilmod.Thing" in line and "must hold only tensors" in line


# -- every checkpoint checked ---------------------------------------------------------------------------

def test_a_flipped_bit_in_a_shard_is_named(plain: Path, tmp_path: Path) -> None:
    folder = as_sharded(plain, tmp_path / "sharded.ckpt")
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    assert check(folder) == (f"trainer.ckpt_path={folder}: cannot load sharded checkpoint {folder}: __0_0.distcp "
                             "does not match the checksum written with it (the file was damaged or changed after "
                             "it was saved); use an earlier checkpoint")
    with pytest.raises(CheckpointError, match="__0_0.distcp does not match"):
        SingleDeviceStrategy().load_checkpoint(folder)


def test_an_edited_state_file_is_caught_by_the_checksum(plain: Path, tmp_path: Path) -> None:
    folder = as_sharded(plain, tmp_path / "sharded.ckpt")
    state = torch.load(folder / "state.pt", weights_only=True)
    state["step"] = 1
    torch.save(state, folder / "state.pt")
    assert "state.pt does not match the checksum" in check(folder)


def test_damaged_metadata_is_one_line(plain: Path, tmp_path: Path) -> None:
    folder = as_sharded(plain, tmp_path / "sharded.ckpt")
    (folder / ".metadata").write_bytes((folder / ".metadata").read_bytes()[:100])
    manifest.write(folder)  # matching checksums: the bytes themselves are what is wrong
    assert f"{folder / '.metadata'} is damaged or not DCP metadata" in check(folder)


def test_metadata_declaring_a_huge_tensor_is_refused_before_allocating(plain: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """A .metadata (checksums made to match) that declares net.0.weight as 10^6 x 10^6 floats, 3.6 TiB its shard
    does not hold: export and a resume refuse it in one line instead of allocating it."""
    from runner.checkpoint_io.dcp_metadata import read_metadata

    folder = as_sharded(plain, tmp_path / "sharded.ckpt")
    metadata = read_metadata(folder)
    item = metadata.state_dict_metadata["model.net.0.weight"]
    item.size = torch.Size([10**6, 10**6])
    item.chunks[0].sizes = torch.Size([10**6, 10**6])
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest.write(folder)
    line = (f"cannot load sharded checkpoint {folder}: its .metadata declares model.net.0.weight as 1000000 x 1000000 "
            "float32 (3.6 TiB), but its shard files hold ")
    assert export_main([str(folder), str(tmp_path / "weights.pt")]) == 1
    (error,) = capsys.readouterr().err.splitlines()
    assert error.startswith(f"error: {line}") and "refused before allocating it" in error, error
    assert check(folder).endswith(error[len("error: "):])  # a resume: before any worker starts


def test_a_folder_without_checksums_needs_an_explicit_trust(plain: Path, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    folder = as_sharded(plain, tmp_path / "sharded.ckpt")
    (folder / "checksums.json").unlink()
    assert ("has no checksums.json, so damage or edits cannot be detected; to load it anyway name it explicitly "
            "with trainer.ckpt_path=<path> trainer.trust_unchecked_checkpoint=true") in check(folder)
    validate(compose_config([*SMALL, f"trainer.ckpt_path={folder}", "trainer.trust_unchecked_checkpoint=true"]),
             str(folder))
    assert SingleDeviceStrategy().load_checkpoint(folder, trust_unchecked=True)["step"] == 2
    assert "without checksums" in caplog.text


def test_a_plain_file_without_its_checksum_needs_an_explicit_trust(plain: Path, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    checkpoint = torch.load(plain, weights_only=True)
    del checkpoint[CHECKSUM_KEY]
    checkpoint["model"]["net.0.weight"] += 1.0  # tampered, and nothing would tell
    torch.save(checkpoint, plain)
    assert f"it carries no {CHECKSUM_KEY}, so damage or edits cannot be detected" in check(plain)
    with pytest.raises(CheckpointError, match="carries no checksum_crc32"):
        SingleDeviceStrategy().load_checkpoint(plain)
    # Named explicitly and trusted: it loads, with a warning. Found by `last`: the trust does not apply.
    validate(compose_config([*SMALL, f"trainer.ckpt_path={plain}", "trainer.trust_unchecked_checkpoint=true"]),
             str(plain))
    assert "without a checksum" in caplog.text
    with pytest.raises(ConfigError, match="carries no checksum_crc32"):
        validate(compose_config([*SMALL, "trainer.ckpt_path=last", "trainer.trust_unchecked_checkpoint=true"]),
                 str(plain))
    assert export_main([str(plain), str(tmp_path / "w.pt")]) == 1
    assert export_main([str(plain), str(tmp_path / "w.pt"), "--trust-unchecked"]) == 0


def test_non_finite_weights_are_refused_in_files_and_folders(plain: Path, tmp_path: Path) -> None:
    resave(plain, lambda c: c["model"]["net.0.weight"].__setitem__((0, 0), float("nan")))
    assert check(plain).endswith("its weights net.0.weight hold NaN or inf; use an earlier checkpoint")
    folder = as_sharded(plain, tmp_path / "sharded.ckpt")
    assert check(folder).endswith("its weights net.0.weight hold NaN or inf; use an earlier checkpoint")
    assert export_main([str(folder), str(tmp_path / "w.pt")]) == 1


@pytest.mark.parametrize("step", [-5, 10**13, 2.5, True])
def test_an_impossible_step_is_refused(plain: Path, step: object) -> None:
    resave(plain, lambda c: c.__setitem__("step", step))
    assert f"its step is {step!r}, not a whole number from 0 to 1e+12: the file was damaged or edited" in check(plain)


def test_a_checkpoint_of_another_task_is_refused_naming_both(plain: Path) -> None:
    assert torch.load(plain, weights_only=True)["task"] == "runner.tasks.supervised.ClassificationTask"
    resave(plain, lambda c: c.__setitem__("task", "runner.tasks.supervised.RegressionTask"))
    assert check(plain).endswith("it was trained for task runner.tasks.supervised.RegressionTask, this run's task "
                                 "is runner.tasks.supervised.ClassificationTask; resume with the task it was saved "
                                 "with")


# -- which checkpoint `last` takes ------------------------------------------------------------------------

def test_a_run_folder_resumes_its_own_step_checkpoint_not_another_runs_last(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    a, b = tmp_path / "outputs" / "a", tmp_path / "outputs" / "b"
    train(a, "trainer.ckpt_every_n_steps=1")
    (a / "checkpoints" / "last.ckpt").unlink()  # killed before its first last.ckpt: step-1 and step-2 remain
    train(b, "trainer.max_steps=3")  # newer, of the same config
    cfg = compose_config([*SMALL, "trainer.max_steps=4", "trainer.ckpt_path=last"])
    assert resolve_ckpt_path(cfg, a) == str(a / "checkpoints" / "step-000002.ckpt")
    assert resolve_ckpt_path(cfg, tmp_path / "outputs" / "c") == str(b / "checkpoints" / "last.ckpt")
    for name in ("step-000001.ckpt", "step-000002.ckpt"):
        (a / "checkpoints" / name).unlink()
    assert resolve_ckpt_path(cfg, a) is None  # its own folder holds nothing: from the start, never b's
    assert runner.fit(cfg, run_dir=a)["step"] == 4
    assert "resuming" not in (a / "runner.log").read_text()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_last_never_takes_a_run_of_another_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    other = tmp_path / "outputs" / "other"
    train(other)
    cfg = compose_config([*SMALL, "trainer.ckpt_path=last"])
    assert resolve_ckpt_path(cfg, tmp_path / "outputs" / "new") == str(other / "checkpoints" / "last.ckpt")
    os.chown(other / "checkpoints" / "last.ckpt", 4321, 4321)
    assert resolve_ckpt_path(cfg, tmp_path / "outputs" / "new") is None


# -- strategies taking turns in one run folder ----------------------------------------------------------------

def test_a_file_replaces_a_sharded_folder_and_the_reverse(plain: Path, tmp_path: Path) -> None:
    path = tmp_path / "checkpoints" / "last.ckpt"
    as_sharded(plain, path)
    checkpoint = TorchCheckpointIO().load_checkpoint(plain)
    TorchCheckpointIO().save_checkpoint(checkpoint, path)
    assert path.is_file() and os.listdir(path.parent) == ["last.ckpt"]
    as_sharded(plain, path)
    assert sharded.is_sharded(path) and os.listdir(path.parent) == ["last.ckpt"]
    SingleDeviceStrategy().remove_checkpoint(path)
    assert not path.exists()
    (tmp_path / "data").mkdir()  # any other folder is not a checkpoint to replace
    with pytest.raises(CheckpointError, match="not a sharded checkpoint"):
        TorchCheckpointIO().save_checkpoint(checkpoint, tmp_path / "data")


@pytest.mark.slow
def test_fsdp_single_fsdp_ddp_fsdp_take_turns_in_one_run_folder(tmp_path: Path) -> None:
    """Each run resumes where the last stopped, whatever wrote it; nothing is lost on the way."""
    run = tmp_path / "run"
    two = ("trainer.devices=2", "data.batch_size=8")
    turns = [("strategy=fsdp", *two), ("strategy=single", "data.batch_size=16"), ("strategy=fsdp", *two),
             ("strategy=ddp", *two), ("strategy=fsdp", *two)]
    for index, turn in enumerate(turns):
        steps = 2 * (index + 1)
        # keep_last_k=1: each run removes the step-N checkpoint the run before wrote, folder or file.
        result = train(run, *turn, f"trainer.max_steps={steps}", "trainer.ckpt_every_n_steps=2",
                       "trainer.keep_last_k=1", *(["trainer.ckpt_path=last"] if index else []))
        assert result["step"] == steps, turn
        last = run / "checkpoints" / "last.ckpt"
        assert last.is_dir() == (turn[0] == "strategy=fsdp")
        assert SingleDeviceStrategy().load_checkpoint(last)["step"] == steps
        this_run = (run / "runner.log").read_text().rsplit("config hash", 1)[-1]
        assert f"starting at step {steps - 2} " in this_run  # resumed where the run before stopped
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt", f"step-{steps:06d}.ckpt"]
