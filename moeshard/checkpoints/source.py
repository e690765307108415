"""A source checkpoint folder: config files, index and tensor headers; slices read on demand."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from moeshard.checkpoints.ranged import RangeCache
from moeshard.checkpoints.safetensors_io import DTYPES, INDEX_NAME, SINGLE_NAME, TensorInfo, pread_into, read_header
from moeshard.errors import MoeshardError
from moeshard.files import load_json
from moeshard.paths import inside

_LOW7, _ONES, _HIGH = 0x7F7F7F7F7F7F7F7F, 0x0101010101010101, 0x8080808080808080 - (1 << 64)


def nan_mask(t: torch.Tensor, nvfp4: bool) -> torch.Tensor:
    """Where the block scale codes ``t`` (any 1-byte dtype) are NaN: E4M3 0x7F / 0xFF (NVFP4),
    UE8M0 0xFF (MXFP4); a bool tensor of ``t``'s shape."""
    b = t.view(torch.uint8)
    return (b | 0x80) == 0xFF if nvfp4 else b == 0xFF


def has_nan(t: torch.Tensor, nvfp4: bool) -> bool:
    """Whether :func:`nan_mask` has any True, eight codes at a time: in a word of eight codes,
    ``(w & 0x7F..7F) + 0x01..01`` sets a code's top bit exactly when its low 7 bits are all ones
    (no carry crosses codes); MXFP4 also needs the code's own top bit."""
    b = t.reshape(-1).view(torch.uint8)
    n = b.numel() // 8 * 8 if b.storage_offset() % 8 == 0 else 0
    words = b[:n].view(torch.int64) if n else torch.empty(0, dtype=torch.int64)
    step = 1 << 17
    tmp = torch.empty(min(words.numel(), step), dtype=torch.int64)  # 1 MiB, reused: no fresh pages per step
    for k in range(0, words.numel(), step):
        w = words[k:k + tmp.numel()]
        hit = torch.bitwise_and(w, _LOW7, out=tmp[:w.numel()]).add_(_ONES).bitwise_and_(_HIGH)
        if (hit if nvfp4 else hit.bitwise_and_(w)).any():
            return True
    return bool(nan_mask(b[n:], nvfp4).any())


class Checkpoint:
    """A Hugging Face style safetensors checkpoint on local disk.

    Holds config.json, the optional hf_quant_config.json, and every tensor's header
    (:class:`TensorInfo`); tensor bytes are read only by :meth:`read`, and only the requested
    slice. In a Hub run's ranged cache (:mod:`moeshard.checkpoints.ranged`), a read of bytes that
    were not fetched is refused.
    """

    def __init__(self, root: Path, *, with_config: bool = True, partial: bool = False):
        """``partial``: a rank-only download; shards the index names but that were not fetched
        are allowed, and their tensors (:attr:`absent`) are skipped by header checks."""
        self.root = Path(root)
        self.partial = partial
        self.absent: set[str] = set()
        if not self.root.is_dir():
            raise MoeshardError(f"{self.root}: not a folder (expected a checkpoint folder or a Hub repo id)")
        self.config = load_json(self.file("config.json")) if with_config else {}
        qpath = self.file("hf_quant_config.json")
        self.quant_config = load_json(qpath) if with_config and qpath.is_file() else None
        self.ranges = RangeCache.at(self.root)
        self.tensors = self._read_headers()
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0  # tensor bytes returned by read(), for throughput reports

    def file(self, rel: str, where: str | None = None) -> Path:
        """The path of ``rel`` in the checkpoint, refusing names and symlinks that lead outside it
        (:func:`moeshard.paths.inside`)."""
        return inside(self.root, rel, where or str(self.root), "file")

    def _read_headers(self) -> dict[str, TensorInfo]:
        index = self.file(INDEX_NAME)
        if index.is_file():
            weight_map = load_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise MoeshardError(f"{index}: expected a non-empty 'weight_map', found {type(weight_map).__name__}")
            files = sorted(set(weight_map.values()))
            for name in files:  # every name is checked before any file is opened
                if not isinstance(name, str):
                    raise MoeshardError(f"{index}: weight_map: expected file names, found {name!r}")
                self.file(name, f"{index}: weight_map")
        elif self.file(SINGLE_NAME).is_file():
            weight_map, files = None, [SINGLE_NAME]
        else:
            raise MoeshardError(f"{self.root}: no {INDEX_NAME} and no {SINGLE_NAME}")
        tensors: dict[str, TensorInfo] = {}
        missing = set()
        for name in files:
            path = self.file(name)
            if not path.is_file():
                if self.partial:
                    missing.add(name)
                    continue
                raise MoeshardError(f"{index}: names shard {name}, which is missing from {self.root}")
            tensors.update(read_header(path))
        if weight_map is not None:
            self.absent = {k for k, f in weight_map.items() if f in missing}
            for k, f in weight_map.items():
                if f in missing:
                    continue
                if k not in tensors or tensors[k].file != f:
                    raise MoeshardError(f"{index}: maps {k} to {f}, but {f} does not hold it")
        return tensors

    @property
    def files(self) -> list[str]:
        return sorted({t.file for t in self.tensors.values()})

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            if name in self.absent:
                raise MoeshardError(f"{self.root}: tensor {name} was not downloaded (a rank-only run fetched only "
                                    "the shards its ranks need)")
            raise MoeshardError(f"{self.root}: tensor {name} missing from the checkpoint")
        return self.tensors[name]

    def expect(self, name: str, dtype: str | tuple[str, ...], shape: tuple[int, ...] | None, why: str = "",
               scalar_ok: bool = False) -> TensorInfo | None:
        """Check one tensor's header, raising a MoeshardError naming file, tensor, expected, found.

        ``dtype``: a dtype code or the codes accepted; ``shape`` None: any; ``why`` says where the expected shape comes
        from (e.g. the config values), for the message; ``scalar_ok`` accepts ``[1]`` for an
        expected ``[]``. Returns None, checking nothing, for a tensor of a partial checkpoint that
        was not downloaded.
        """
        if name in self.absent:
            return None
        t = self.info(name)
        if t.dtype not in ((dtype,) if isinstance(dtype, str) else dtype):
            raise MoeshardError(f"{t.file}: {name}: expected dtype {' or '.join((dtype,) if isinstance(dtype, str) else dtype)}, "
                                f"found {t.dtype}")
        if shape is not None and t.shape != tuple(shape) and not (scalar_ok and shape == () and t.shape == (1,)):
            raise MoeshardError(f"{t.file}: {name}: expected shape {list(shape)}{f' ({why})' if why else ''}, "
                                f"found {list(t.shape)}")
        return t

    def check_scales(self, name: str, t: torch.Tensor, nvfp4: bool, first_expert: int = 0) -> torch.Tensor:
        """Refuse block scales that would poison the kernel: NaN codes (E4M3 0x7F/0xFF, UE8M0 0xFF).

        ``t`` holds the bytes of ``name`` (rows of experts from ``first_expert`` on, or one expert).
        """
        if has_nan(t, nvfp4):
            b, bad = t.view(torch.uint8), nan_mask(t, nvfp4)
            where = [int(v) for v in bad.nonzero()[0]]
            if len(where) == 3:
                where[0] += first_expert
            kind = "E4M3" if nvfp4 else "UE8M0"
            raise MoeshardError(f"{self.info(name).file}: {name}: expected finite {kind} block scales, found NaN "
                                f"(0x{int(b[bad][0]):02X}) at index {where}; it would poison the kernel")
        return t

    def read(self, name: str, start: int | None = None, stop: int | None = None, pin: bool = False,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``name``, or its rows ``[start, stop)`` along dim 0, as a new CPU tensor (in
        pinned memory with ``pin``, for asynchronous copies to a GPU), or read into ``out`` (a
        contiguous CPU tensor of the same number of bytes, any dtype; returned as given): one
        ``pread`` of exactly its bytes (safe from several threads at once)."""
        t = self.info(name)
        if t.dtype == "F4":
            raise MoeshardError(f"{self.root / t.file}: {name}: dtype F4 is not supported (FP4 checkpoints store "
                                "packed codes as U8)")
        n = t.shape[0] if t.shape else 1
        a, b = (0, n) if start is None and stop is None else slice(start, stop).indices(n)[:2]
        b, row = max(a, b), t.nbytes // n if n else 0
        first, end = t.offset + a * row, t.offset + b * row
        if self.ranges is not None and not self.ranges.covers(t.file, first, end):
            raise MoeshardError(f"{self.root / t.file}: {name}: bytes {first}-{end - 1} were not fetched (a rank-only "
                                "Hub run fetches only the byte ranges its ranks read)")
        if out is None:
            out = torch.empty((b - a, *t.shape[1:]) if t.shape else (), dtype=DTYPES[t.dtype], pin_memory=pin)
        elif not out.is_contiguous() or out.numel() * out.element_size() != end - first:
            raise ValueError(f"{name}: out holds {out.numel() * out.element_size()} bytes (contiguous: "
                             f"{out.is_contiguous()}), the rows read {end - first}")
        if end > first:
            pread_into(self._fd(t.file), memoryview(out.reshape(-1).view(torch.uint8).numpy()), first,
                       f"{self.root / t.file} (tensor {name})")
        with self._lock:
            self.bytes_read += end - first
        return out

    def _fd(self, rel: str) -> int:
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                fd = self._fds[rel] = os.open(self.root / rel, os.O_RDONLY)
            return fd

    def prefetch(self, name: str, start: int | None = None, stop: int | None = None) -> None:
        """Ask the kernel to start reading tensor ``name`` (or its rows ``[start, stop)``) now
        (``posix_fadvise(WILLNEED)``), so that a later :meth:`read` finds it in the page cache
        instead of faulting it in page by page through the memory map."""
        t = self.tensors.get(name)
        if t is None or t.offset < 0 or not hasattr(os, "posix_fadvise"):
            return
        row = t.nbytes // t.shape[0] if t.shape and t.shape[0] else t.nbytes
        a = t.offset + (start or 0) * row
        b = t.offset + (t.nbytes if stop is None else stop * row)
        os.posix_fadvise(self._fd(t.file), a, b - a, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Checkpoint"]
