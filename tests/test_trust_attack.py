"""Attacks on the trust guarantees from outside: crafted files, shared folders, parallel callers."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest

from runner import run_lock
from _dist import clean_environ


def _text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _class_attribute_payload(module: str, name: str, attribute: str, value: str) -> bytes:
    """A pickle that BUILDs on an allowed class itself, (None, {attribute: value}) as its slot state: the
    unpickler's default BUILD then sets the attribute on the class, for the whole process."""
    return (b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"N}" + _text(attribute) + _text(value)
            + b"s\x86b.")


READ_THEN_WRITE = """
import sys
from pathlib import Path
from runner.checkpoint_io.base import CheckpointError
from runner.checkpoint_io.dcp_metadata import read_metadata
try:
    read_metadata(sys.argv[1])
except CheckpointError as err:
    print("refused:", err)
with open(Path(sys.argv[2]), "w") as stream:  # what the process writes next, through a Path
    stream.write("ordinary file")
"""


def test_metadata_cannot_change_a_class_for_the_rest_of_the_process(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    folder = tmp_path / "evil.ckpt"
    folder.mkdir()
    payload = _class_attribute_payload("pathlib", "PosixPath", "_str", str(marker))
    (folder / ".metadata").write_bytes(payload)
    # The manifest is a plain CRC: whoever writes the folder writes a matching one.
    (folder / "checksums.json").write_text(json.dumps({"algorithm": "crc32",
                                                       "files": {".metadata": zlib.crc32(payload)}}))
    ordinary = tmp_path / "ordinary.txt"
    probe = subprocess.run([sys.executable, "-c", READ_THEN_WRITE, str(folder), str(ordinary)],
                           capture_output=True, text=True, env=clean_environ(), timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert "refused:" in probe.stdout
    assert not marker.exists()
    assert ordinary.read_text() == "ordinary file"


def test_the_busy_folder_refusal_crosses_process_boundaries(tmp_path: Path) -> None:
    busy = run_lock.RunFolderBusy(tmp_path, "1234")
    again = pickle.loads(pickle.dumps(busy))
    assert str(again) == str(busy)


def test_a_second_thread_cannot_take_a_folder_another_thread_holds(tmp_path: Path) -> None:
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        run_lock.acquire(tmp_path)
        taken.set()
        done.wait(60)
        run_lock.release(tmp_path)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert taken.wait(60)
        with pytest.raises(run_lock.RunFolderBusy):
            run_lock.acquire(tmp_path)
            run_lock.release(tmp_path)  # taken after all: give it back before failing
    finally:
        done.set()
        holder.join(60)


@pytest.mark.parametrize("module, name, attribute", [
    ("torch.serialization", "_get_layout", "cache"),             # a function's __dict__
    ("torch.distributed.checkpoint.metadata", "Metadata", "planner_data"),  # a dataclass's class attribute
])
def test_metadata_cannot_give_state_to_an_allowed_class_or_function(tmp_path: Path, module: str, name: str,
                                                                    attribute: str) -> None:
    import importlib

    from runner.checkpoint_io.base import CheckpointError
    from runner.checkpoint_io.dcp_metadata import read_metadata

    target = getattr(importlib.import_module(module), name)
    before = dict(vars(target))
    folder = tmp_path / "evil.ckpt"
    folder.mkdir()
    # BUILD with a plain dict state: setattr on the target itself.
    (folder / ".metadata").write_bytes(b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"}" + _text(attribute)
                                       + _text("poisoned") + b"sb.")
    with pytest.raises(CheckpointError, match="refused without running it"):
        read_metadata(folder)
    assert dict(vars(target)) == before
