"""safetensors access: one dtype table, header-only reads, sharded writes of small files.

Reads go through ``safetensors.safe_open`` (``keys``, ``get_slice``, ``get_tensor``), which
memory-maps the file: a slice reads only its own bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from moeshard.errors import MoeshardError
from moeshard.files import write_json

#: safetensors header dtype code -> torch dtype (every code the installed safetensors knows).
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
    "C64": torch.complex64,
}

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
GB = 10**9
_UMASK = os.umask(0)
os.umask(_UMASK)


@dataclass(frozen=True)
class TensorInfo:
    """Header facts of one tensor: its file (relative to the checkpoint), dtype code, shape, and
    the file offset of its first byte (-1 if unknown)."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = -1

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.dtype, self.shape)


def tensor_bytes(dtype: str, shape) -> int:
    """Bytes of a tensor of safetensors dtype code ``dtype`` and ``shape`` (the one rule: every
    header, plan and writer sizes its tensors with it)."""
    return DTYPES[dtype].itemsize * math.prod(shape)


#: safetensors refuses headers larger than this (``safetensors/src/tensor.rs``, MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000


def header_length(path: Path, head: bytes, size: int) -> int:
    """The header length a safetensors file declares in its first 8 bytes, checked against the file
    size and safetensors' limit (the message never repeats the bytes: the file may not be one)."""
    if len(head) < 8:
        raise MoeshardError(f"{path}: not a safetensors file: expected an 8-byte header length, found {len(head)} bytes")
    (n,) = struct.unpack("<Q", head)
    if n + 8 > size or n > MAX_HEADER_BYTES:
        raise MoeshardError(f"{path}: truncated safetensors header (or not a safetensors file): the header length "
                            f"it declares exceeds the file size ({size} bytes) or safetensors' "
                            f"{MAX_HEADER_BYTES // 10**6} MB limit")
    return n


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor headers of one safetensors file, read without touching tensor bytes.

    Raises MoeshardError naming the file when the header is truncated or not safetensors.
    """
    from safetensors import SafetensorError, safe_open

    size = path.stat().st_size
    with open(path, "rb") as f:
        n = header_length(path, f.read(8), size)
        raw = f.read(n)
    try:
        out = {}
        with safe_open(path, framework="pt") as f:  # safetensors validates the header and the offsets
            header = json.loads(raw)
            for k in f.keys():
                s = f.get_slice(k)
                out[k] = TensorInfo(path.name, s.get_dtype(), tuple(s.get_shape()), 8 + n + header[k]["data_offsets"][0])
        return out
    except (SafetensorError, OSError, ValueError) as e:
        raise MoeshardError(f"{path}: unreadable safetensors file: {e}") from None


def pread_into(fd: int, view: memoryview, offset: int, what: str) -> None:
    """Fill ``view`` with the bytes of ``fd`` from ``offset`` on (``preadv``, short reads continued);
    a MoeshardError naming ``what`` if the file ends first."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise MoeshardError(f"{what}: ended {len(view) - got} bytes early")
        got += n


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                      atomic: bool = True) -> None:
    """``safetensors.torch.save_file``; with ``atomic`` under a temporary name, then renamed."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp") if atomic else path
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata or {"format": "pt"})
    os.chmod(tmp, 0o666 & ~_UMASK)  # safetensors creates 0600; make it like any other file
    if atomic:
        os.replace(tmp, path)


def shard_names(n: int, zero_based: bool = False) -> list[str]:
    """HF shard file names: ``model-00001-of-00003.safetensors`` (``model-00000-of-00002`` zero-based,
    as openai/gpt-oss names them); ``model.safetensors`` alone when n == 1 and not zero-based."""
    if n == 1 and not zero_based:
        return [SINGLE_NAME]
    if zero_based:
        return [f"model-{i:05d}-of-{n - 1:05d}.safetensors" for i in range(n)]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def pack_groups(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Greedy in-order packing of items into groups of at most ``max_bytes`` (an item larger
    than the cap gets a group of its own; no empty groups)."""
    groups: list[list[int]] = []
    total = 0
    for i, s in enumerate(sizes):
        if not groups or (total + s > max_bytes and total > 0):
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += s
    return groups or [[]]


def index_doc(weight_map: dict[str, str], total_size: int) -> dict:
    """``model.safetensors.index.json`` content: ``metadata.total_size`` and a sorted ``weight_map``."""
    return {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    write_json(folder / INDEX_NAME, index_doc(weight_map, total_size))
