"""DCP's `.metadata` read as data: an unpickler that admits DCP's own metadata classes and nothing that runs code.

torch.distributed.checkpoint writes `.metadata` with pickle and reads it with `pickle.load`, so a folder anyone
left with a crafted `.metadata` would run its code in every process that opens it. What a real one holds (listed
from checkpoints the runner wrote): DCP's metadata dataclasses, the `_StorageInfo` of its file system writer,
torch dtypes, `torch.Size`, the layout look-up `torch.serialization._get_layout`, a `pathlib` path and plain
containers. Anything else is refused by name, before it is looked up.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from runner.checkpoint_io.base import CheckpointError

METADATA_FILE = ".metadata"
_MAX_BYTES = 1 << 30  # a metadata file is kilobytes per tensor; more than this is not one
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a dict look-up of torch's layouts by name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "builtins": {"dict", "list", "tuple", "set", "frozenset"},
    "collections": {"OrderedDict"},
}
_SHARD_NAME = re.compile(r"__\d+_\d+\.distcp")


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a global outside the allowed set."""


# The classes whose instances a pickle may give state to (BUILD). Without this limit BUILD on an allowed class or
# function itself sets attributes on it for the whole process (`PosixPath._str`: every later path goes where the
# file says), so state is only accepted by instances of DCP's metadata dataclasses.
_STATEFUL = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                 "ChunkStorageMetadata", "MetadataIndex", "StorageMeta")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _Unpickler(pickle._Unpickler):  # the Python unpickler: the C one cannot be told which BUILDs to refuse
    dispatch = dict(pickle._Unpickler.dispatch)

    def load_build(self) -> None:
        target = self.stack[-2]
        kind = type(target)
        if isinstance(target, type) or (kind.__module__, kind.__qualname__) not in _STATEFUL:
            described = getattr(target, "__qualname__", None) or kind.__qualname__
            raise RefusedGlobal(f"state for {getattr(target, '__module__', kind.__module__)}.{described}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        # vars(), not getattr: torch's module __getattr__ imports submodules for some names.
        if module == "torch" and isinstance(vars(torch).get(name), (torch.dtype, torch.memory_format)):
            return vars(torch)[name]
        raise RefusedGlobal(f"{module}.{name}")


def read_metadata(folder: Any) -> Any:
    """The DCP Metadata of the sharded checkpoint `folder`, or CheckpointError naming the file and what is wrong."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = Path(folder) / METADATA_FILE
    try:
        with open(file, "rb") as stream:
            data = stream.read(_MAX_BYTES + 1)
    except OSError as err:
        raise CheckpointError(f"cannot read {file}: {err.strerror or err}") from None
    try:
        if len(data) > _MAX_BYTES:
            raise pickle.UnpicklingError("larger than any checkpoint's metadata")
        metadata = _Unpickler(io.BytesIO(data)).load()
    except RefusedGlobal as err:
        raise CheckpointError(f"cannot load sharded checkpoint {folder}: {file} names {err}, which DCP's metadata "
                              "never holds; refused without running it (checkpoints hold data only)") from None
    except Exception as err:  # noqa: BLE001 - any failure of the bytes themselves
        raise CheckpointError(f"cannot load sharded checkpoint {folder}: {file} is damaged or not DCP metadata "
                              f"({type(err).__name__}: {str(err)[:200]}); use an earlier checkpoint") from None
    problem = _shape_problem(metadata, Metadata)
    if problem:
        raise CheckpointError(f"cannot load sharded checkpoint {folder}: {file} is not DCP metadata the runner "
                              f"wrote ({problem}); use an earlier checkpoint")
    return metadata


def _shape_problem(metadata: Any, metadata_class: type) -> str:
    """What makes unpickled data unfit to be read as the runner's metadata ('' when it fits)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    if not isinstance(metadata, metadata_class):
        return f"it holds a {type(metadata).__name__}"
    entries = (metadata.state_dict_metadata, metadata.planner_data, metadata.storage_data)
    if not all(isinstance(entry, dict) for entry in entries):
        return "its entries are not dicts"
    for key in metadata.state_dict_metadata:
        where = metadata.planner_data.get(key)
        if not (isinstance(where, tuple) and where and all(isinstance(part, str) for part in where)):
            return f"entry {key!r} has no place in the checkpoint"
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        # Shards are files of this folder, read as written: another path or a transform is not the runner's.
        if not (isinstance(index, MetadataIndex) and isinstance(info, _StorageInfo) and isinstance(name, str)
                and _SHARD_NAME.fullmatch(name) and not info.transform_descriptors
                and all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length))):
            return f"its entry {getattr(index, 'fqn', index)!r} points at {name!r}, not a part of a shard file"
    return ""


def safe_reader(folder: Any) -> Any:
    """DCP's FileSystemReader on `folder`, its metadata read by `read_metadata` (DCP's load asks it too)."""
    import torch.distributed.checkpoint as dcp

    class SafeFileSystemReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = read_metadata(folder)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(folder))
