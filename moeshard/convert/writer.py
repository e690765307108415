"""A safetensors writer that knows every tensor's shape up front and writes tensors into place.

The header is computed from the plan, so a rank file can be filled expert chunk by expert chunk
(``pwrite`` at the tensor's offset plus the chunk's first expert times the bytes per expert)
without ever holding a whole layer, let alone a whole file, in memory. Files are plain
safetensors: any reader opens them (tests read them back with ``safetensors.safe_open``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from moeshard.convert.io import DTYPES


class StreamingWriter:
    """Write one safetensors file whose tensors (name, dtype code, shape) are known in advance.

    Parameters
    ----------
    path : the file to create (the caller renames it into place)
    tensors : ``[(name, dtype_code, shape), ...]`` in file order
    metadata : ``__metadata__`` of the header

    Tensors are laid out without gaps, wider dtypes first (then in the given order), so that every
    tensor starts at a multiple of its element size, as safetensors' own writer arranges them;
    the header is padded with spaces to a multiple of 8 bytes. A loader can then view each
    tensor in place in one buffer holding the file. :meth:`write` may be called from a
    thread other than the one that created the writer.
    """

    def __init__(self, path: Path, tensors: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        self.offsets: dict[str, tuple[int, int, int]] = {}  # name -> (begin, end, bytes per dim-0 row)
        pos = 0
        for name, dtype, shape in sorted(tensors, key=lambda t: -DTYPES[t[1]].itemsize):
            n = DTYPES[dtype].itemsize
            for d in shape:
                n *= d
            row = n // shape[0] if shape and shape[0] else n
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
            self.offsets[name] = (pos, pos + n, row)
            pos += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.data_start = 8 + len(raw)
        self.size = self.data_start + pos
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        # No posix_fallocate: on some file systems it makes every later write several times slower
        # (measured 12x here); free space is checked before the conversion starts instead.
        try:
            self._pwrite(len(raw).to_bytes(8, "little") + raw, 0)
        except BaseException:
            os.close(self.fd)
            raise

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def write(self, name: str, t: torch.Tensor, first_row: int = 0) -> None:
        """Write ``t`` (rows ``[first_row, first_row + len(t))`` of tensor ``name``) into place."""
        begin, end, row = self.offsets[name]
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        offset = begin + first_row * row
        if offset + data.nbytes > end:
            raise ValueError(f"{name}: rows {first_row}+{t.shape[0] if t.dim() else 1} overflow the tensor")
        self._pwrite(data, self.data_start + offset)

    def close(self) -> None:
        os.close(self.fd)
