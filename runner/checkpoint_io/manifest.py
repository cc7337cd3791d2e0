"""The checksum manifest of a sharded checkpoint folder: a CRC-32 of every file, written last, checked first."""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path
from typing import Any

from runner.checkpoint_io.base import CheckpointError

MANIFEST_FILE = "checksums.json"
_BLOCK = 8 << 20
_MAX_BYTES = 16 << 20
log = logging.getLogger("runner")

UNCHECKED_ADVICE = ("damage or edits cannot be detected; to load it anyway name it explicitly with "
                    "trainer.ckpt_path=<path> trainer.trust_unchecked_checkpoint=true (runner.export: "
                    "--trust-unchecked)")


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as stream:
        while block := stream.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def write(folder: Path) -> None:
    """Record every file now in `folder` (all shards, state.pt and .metadata are written by then)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
    manifest = {"algorithm": "crc32", "files": {p.name: file_crc32(p) for p in files}}
    with open(folder / MANIFEST_FILE, "w") as stream:
        json.dump(manifest, stream, indent=1)
        stream.flush()
        os.fsync(stream.fileno())


def verify(folder: Any, trust_unchecked: bool = False) -> None:
    """Every file of the sharded checkpoint `folder` is the one written with it; CheckpointError otherwise.

    Nothing else of the folder is read before this passes. A folder without a manifest (written before there
    was one, or by other tools) is refused unless `trust_unchecked`, which loads it with a warning.
    """
    folder = Path(folder)
    recorded = _recorded(folder, trust_unchecked)
    if recorded is None:
        return
    present = {p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE}
    missing, extra = sorted(recorded.keys() - present), sorted(present - recorded.keys())
    if missing or extra:
        what = f"lacks {', '.join(missing)}" if missing else f"holds files it was not saved with: {', '.join(extra)}"
        raise CheckpointError(f"cannot load sharded checkpoint {folder}: it {what} (see its {MANIFEST_FILE}); "
                              "use an earlier checkpoint")
    for name in sorted(recorded):
        if file_crc32(folder / name) != recorded[name]:
            raise CheckpointError(f"cannot load sharded checkpoint {folder}: {name} does not match the checksum "
                                  "written with it (the file was damaged or changed after it was saved); use an "
                                  "earlier checkpoint")


def _recorded(folder: Path, trust_unchecked: bool) -> dict[str, int] | None:
    """The manifest's {file name: crc32}; None when there is none and the caller trusts the folder anyway."""
    file = folder / MANIFEST_FILE
    if not file.is_file():
        if not trust_unchecked:
            raise CheckpointError(f"cannot load sharded checkpoint {folder}: it has no {MANIFEST_FILE}, so "
                                  f"{UNCHECKED_ADVICE}")
        log.warning("loading %s without checksums (trust_unchecked_checkpoint): damage or edits are not detected",
                    folder)
        return None
    try:
        with open(file, "rb") as stream:
            manifest = json.loads(stream.read(_MAX_BYTES))
        files = manifest["files"]
        valid = (manifest.get("algorithm") == "crc32" and isinstance(files, dict) and
                 all(isinstance(v, int) and "/" not in k and k not in ("", ".", "..") for k, v in files.items()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        valid = False
    if not valid:
        raise CheckpointError(f"cannot load sharded checkpoint {folder}: its {MANIFEST_FILE} is damaged; use an "
                              "earlier checkpoint")
    return files
