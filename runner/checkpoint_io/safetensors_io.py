"""Tensors as a safetensors file, written here byte by byte: the runner does not depend on the safetensors package.

The format (github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and [begin, end) byte offsets in the data that follows (plus a `__metadata__` map of strings),
then the raw little-endian bytes. Tensors that are the same memory under several names (tied weights: GPT-2's
lm_head.weight is transformer.wte.weight) are written once, as safetensors' `save_model` and HuggingFace's
`save_pretrained` do; the names left out are listed in the metadata under `aliases`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Iterable, Mapping, Optional

import torch

from runner import files
from runner.checkpoint_io.base import CheckpointError

ALIASES_KEY = "aliases"  # metadata: JSON {left-out name: the name written}, for a loader that wants every name back

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def aliases(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{name: the earlier name it is the same memory as}: same storage, offset, shape, strides and dtype.

    The first name in the dict's order is kept: a module registers its embeddings before the head tied to them, so
    this keeps the name HuggingFace keeps. Views of one storage that differ (slices) are distinct tensors, each
    written whole."""
    seen: dict[tuple, str] = {}
    found: dict[str, str] = {}
    for name, tensor in tensors.items():
        if tensor.device.type == "meta" or tensor.layout != torch.strided or tensor.numel() == 0:
            continue
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tensor.stride(), tensor.dtype)
        if key in seen:
            found[name] = seen[key]
        else:
            seen[key] = name
    return found


def save_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
              metadata: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Write `tensors` to `path` atomically, each alias once; returns the aliases left out ({} when none)."""
    left_out = aliases(tensors)
    kept = {name: tensor for name, tensor in tensors.items() if name not in left_out}
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    if left_out:
        meta[ALIASES_KEY] = json.dumps(left_out, sort_keys=True)
    header, order = _header(kept, meta)
    write_atomic(os.fspath(path), [header, *(_bytes(kept[name]) for name in order)])
    return left_out


def _header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[bytes, list[str]]:
    """The length-prefixed JSON header, and the order the data follows in: wider dtypes first, then by name, as the
    safetensors package lays them out (each tensor then starts aligned to its element size)."""
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise CheckpointError(f"cannot write {name} as safetensors: its dtype {tensor.dtype} has no safetensors "
                                  f"code (allowed: {', '.join(str(d) for d in DTYPES)})")
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            raise CheckpointError(f"cannot write {name} as safetensors: a {tensor.layout} tensor on "
                                  f"{tensor.device.type} holds no plain bytes")
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    entries: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        size = tensors[name].numel() * tensors[name].element_size()
        entries[name] = {"dtype": DTYPES[tensors[name].dtype], "shape": list(tensors[name].shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data then starts 8-byte aligned (the format allows trailing spaces)
    return len(text).to_bytes(8, "little") + text, order


def _bytes(tensor: torch.Tensor) -> memoryview:
    if sys.byteorder != "little":
        raise CheckpointError("safetensors is little-endian: export on a little-endian machine")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_atomic(path: str, chunks: Iterable[bytes | memoryview]) -> None:
    """runner.files.write_atomic: never half a file at `path`, never through a link there; a failed write is a
    CheckpointError."""
    try:
        files.write_atomic(path, chunks)
    except OSError as err:
        raise CheckpointError(f"cannot write {path}: {err}; nothing was replaced") from err
