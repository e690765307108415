"""A safetensors writer that knows every tensor's shape up front and takes the bytes in file order.

The header is computed from the plan, so a file is produced front to back, chunk by chunk,
without ever holding a whole tensor, let alone a whole file, in memory: the caller asks for
the next ``n`` bytes (:meth:`SequentialWriter.take`), fills them in place, and asks for more.
Full staging buffers are written by one thread and hashed (SHA-256) by another while the caller
fills the next one, so the file's hash costs no second read. Writes bypass the page cache
(``O_DIRECT``) where the file system allows it: on a small machine the kernel's copy into the
page cache costs as much CPU as the conversion itself. Files are plain safetensors: any reader
opens them (tests read them back with ``safetensors.safe_open``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from moeshard.checkpoints.safetensors_io import DTYPES, tensor_bytes

#: O_DIRECT needs buffer addresses, file offsets and lengths on this boundary.
ALIGN = 4096
#: Staging buffer size (a writer fills one while up to two more are written and hashed).
BUFFER_BYTES = 64 << 20
BUFFERS = 3
#: Staging buffers alive in this process at once: a finished file's last buffers may still be
#: hashing while the next file fills its own; past this, producers wait (bounded memory).
MAX_BUFFERS = 6

_pool: list[mmap.mmap] = []  # staging buffers kept for the next file
_slots = threading.BoundedSemaphore(MAX_BUFFERS)
_pool_lock = threading.Lock()


def _buffer(size: int) -> mmap.mmap:
    """An anonymous, page-aligned buffer of at least ``size`` bytes (waits while MAX_BUFFERS are alive)."""
    _slots.acquire()
    with _pool_lock:
        for k, buf in enumerate(_pool):
            if len(buf) >= size:
                return _pool.pop(k)
    return mmap.mmap(-1, size)


def _release(buf: mmap.mmap) -> None:
    with _pool_lock:
        _pool.append(buf)
        if len(_pool) > BUFFERS:
            _pool.sort(key=len)
            _pool.pop(0).close()
    _slots.release()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def file_layout(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
                ) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The header bytes (length prefix included) and each tensor's ``(begin, end)`` file offsets.

    Tensors are laid out without gaps, wider dtypes first (then in the given order), so that every
    tensor starts at a multiple of its element size, as safetensors' own writer arranges them;
    the header is padded with spaces to a multiple of 8 bytes. A loader can then view each
    tensor in place in one buffer holding the file. The returned dict is in file order.
    """
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    spans: dict[str, tuple[int, int]] = {}
    pos = 0
    for name, dtype, shape in sorted(tensors, key=lambda t: -DTYPES[t[1]].itemsize):
        n = tensor_bytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        spans[name] = (pos, pos + n)
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = len(raw).to_bytes(8, "little") + raw
    return head, {k: (len(head) + a, len(head) + b) for k, (a, b) in spans.items()}


class SequentialWriter:
    """Write one safetensors file whose tensors (name, dtype code, shape) are known in advance,
    front to back.

    Parameters
    ----------
    path : the file to create (the caller renames it into place)
    tensors : ``[(name, dtype_code, shape), ...]``; :attr:`order` is the file order
    max_take : the largest :meth:`take` the caller will ask for (sizes the staging buffers)
    direct : try ``O_DIRECT``; falls back to buffered writes where the file system refuses it

    Errors of the background writes (``OSError``, e.g. ENOSPC) are raised by the next
    :meth:`take` or by :meth:`close`; :meth:`close` returns while the hash may still be running.
    """

    def __init__(self, path: Path, tensors: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, max_take: int = BUFFER_BYTES, direct: bool = True):
        self.path = Path(path)
        head, self.spans = file_layout(tensors, metadata)
        self.order = list(self.spans)
        self.size = max([len(head)] + [b for _, b in self.spans.values()])
        # Room for a carried-over tail (< ALIGN), the largest take, and the final write's rounding.
        self._cap = -(-max(BUFFER_BYTES, max_take + len(head)) // ALIGN) * ALIGN + 2 * ALIGN
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = direct and hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), 0o666)
        except OSError as e:
            if not self.direct or e.errno != errno.EINVAL:
                raise
            self.direct = False
            self.fd = os.open(self.path, flags, 0o666)
        self._hash = hashlib.sha256()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeshard-write")
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeshard-hash")
        self._inflight: list[tuple[mmap.mmap, Future, Future]] = []
        self._buf = _buffer(self._cap)
        self._fill = 0  # bytes of the current buffer filled
        self._base = 0  # file offset of the current buffer's first byte (a multiple of ALIGN)
        self._put(head)

    @property
    def position(self) -> int:
        return self._base + self._fill

    def take(self, name: str, nbytes: int) -> torch.Tensor:
        """The next ``nbytes`` of the file as a writable uint8 tensor, to be filled before the next
        call; they must lie inside tensor ``name`` (checked: tensors come in :attr:`order`)."""
        begin, end = self.spans[name]
        pos = self.position
        if not begin <= pos or pos + nbytes > end:
            raise ValueError(f"{name}: bytes [{pos}, {pos + nbytes}) are not the next ones of its span [{begin}, {end})")
        if self._fill + nbytes > self._cap - ALIGN:
            self._flush()
            if self._fill + nbytes > self._cap - ALIGN:
                raise ValueError(f"{name}: {nbytes} bytes at once exceed the staging buffer ({self._cap} bytes)")
        view = torch.frombuffer(self._buf, dtype=torch.uint8, count=nbytes, offset=self._fill) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        self._fill += nbytes
        return view

    def put(self, name: str, t: torch.Tensor) -> None:
        """Append all of ``t``'s bytes (a whole small tensor, or the next rows of a large one)."""
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self.take(name, data.numel()).copy_(data)

    def _put(self, data: bytes) -> None:
        self._buf[self._fill:self._fill + len(data)] = data
        self._fill += len(data)

    def _flush(self, final: bool = False) -> None:
        """Hand the current buffer's aligned prefix (all of it when ``final``) to the threads and
        carry its unaligned tail over to the next buffer."""
        for _, w, _ in self._inflight:  # raise a failed write now, not at the end
            if w.done() and w.exception():
                raise w.exception()
        n = -(-self._fill // ALIGN) * ALIGN if final else self._fill // ALIGN * ALIGN
        if final:
            self._buf[self._fill:n] = bytes(n - self._fill)
        buf, fill, base = self._buf, self._fill, self._base
        view = memoryview(buf)
        tail = bytes(view[n:fill])
        self._inflight.append((buf, self._io.submit(self._write, view[:n], base),
                               self._hasher.submit(self._hash.update, view[:fill if final else n])))
        self._buf = None  # the threads own it now; _retire returns it to the pool
        if final:
            return
        while len(self._inflight) >= BUFFERS - 1:
            self._retire()
        self._buf, self._base, self._fill = _buffer(self._cap), base + n, 0
        self._put(tail)

    def _retire(self) -> None:
        buf, w, h = self._inflight.pop(0)
        try:
            w.result()
            h.result()
        finally:
            _release(buf)

    def _write(self, view: memoryview, offset: int) -> None:
        try:
            _pwrite_all(self.fd, view, offset)
        except OSError as e:
            if not self.direct or e.errno != errno.EINVAL:
                raise
            # The file system took O_DIRECT at open but refuses it here: go on through the page cache.
            os.close(self.fd)
            self.fd = os.open(self.path, os.O_WRONLY)
            self.direct = False
            _pwrite_all(self.fd, view, offset)

    def close(self) -> Future:
        """Write what is left, set the exact size and close the file; a future of its SHA-256 (hex),
        which a background thread finishes while the caller goes on (with the next file)."""
        if self.position != self.size:
            self.abort()
            raise ValueError(f"{self.path}: {self.position} of {self.size} bytes were produced")
        try:
            self._flush(final=True)
            for _, w, _ in self._inflight:
                w.result()
            os.ftruncate(self.fd, self.size)  # the last write was padded to the O_DIRECT boundary
        except BaseException:
            self.abort()
            raise
        os.close(self.fd)
        self.fd = -1
        for buf, _, h in self._inflight:
            h.add_done_callback(lambda _, buf=buf: _release(buf))
        self._inflight = []
        digest = self._hasher.submit(self._hash.hexdigest)  # after every update: one thread, in order
        self._io.shutdown(wait=False)
        self._hasher.shutdown(wait=False)
        return digest

    def abort(self) -> None:
        """Wait for the writes and hashes in flight (their errors are dropped) and close the file."""
        while self._inflight:
            try:
                self._retire()
            except OSError:
                pass
        self._io.shutdown()
        self._hasher.shutdown()
        if self._buf is not None:
            _release(self._buf)
            self._buf = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
