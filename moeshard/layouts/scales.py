"""The 128x4 block-scale interleave of FlashInfer's ``block_scale_interleave``, in pure torch.

FlashInfer's own kernel is CUDA-only; this version runs anywhere and is proven byte-identical
to it on the GPU (``tests/gpu/test_block_scale_interleave.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def interleave_scales_128x4(sf: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Swizzle row-major block scales into the 128x4 layout, per expert.

    Mirrors ``flashinfer.block_scale_interleave`` (``csrc/nv_internal/.../quantization.cu``).
    Rows are padded to a multiple of 128 and columns to a multiple of 4 with zeros; within one
    expert byte ``(m, k)`` goes to flat offset
    ``((m // 128 * Kp // 4 + k // 4) * 32 + m % 32) * 16 + (m % 128) // 32 * 4 + k % 4``.

    Parameters
    ----------
    sf : ``[E, M, K]`` uint8 (any 1-byte dtype; bytes are moved, not converted)
    out : optional contiguous ``[E, Mp, Kp]`` 1-byte tensor to write into (e.g. a file's
        staging buffer); must not overlap ``sf``

    Returns
    -------
    ``[E, Mp, Kp]`` of ``sf``'s dtype, Mp = round_up(M, 128), Kp = round_up(K, 4) (``out`` if
    given): contiguous, its flat bytes per expert are the kernel's buffer. Equals the input's
    shape when M % 128 == 0 and K % 4 == 0.
    """
    e, m, k = sf.shape
    mp, kp = _round_up(m, 128), _round_up(k, 4)
    x = sf.view(torch.uint8) if sf.dtype != torch.uint8 else sf
    if (mp, kp) != (m, k):
        x = F.pad(x, (0, kp - k, 0, mp - m))
    x = x.contiguous().view(e, mp // 128, 4, 32, kp // 4, 4)
    dst = (torch.empty_like(x) if out is None else out.view(torch.uint8)).view(e, mp // 128, kp // 4, 32, 4, 4)
    try:  # the 4 bytes of a row's 4 columns move together: copy them as one int32 (7x faster)
        dst.view(torch.int32).copy_(x.view(torch.int32).permute(0, 1, 4, 3, 2, 5))
    except RuntimeError:  # a destination not 4-byte aligned
        dst.copy_(x.permute(0, 1, 4, 3, 2, 5))
    return dst.view(e, mp, kp).view(sf.dtype) if out is None else out


def deinterleave_scales_128x4(buf: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Inverse of :func:`interleave_scales_128x4`.

    Parameters
    ----------
    buf : ``[E, Mp, Kp]`` (or ``[E, Mp * Kp]``) 1-byte dtype, the swizzled buffer
    m, k : the unpadded row-major shape to return

    Returns
    -------
    ``[E, m, k]`` row-major, a new contiguous tensor of ``buf``'s dtype.
    """
    e = buf.shape[0]
    mp, kp = _round_up(m, 128), _round_up(k, 4)
    if buf[0].numel() != mp * kp:
        raise ValueError(f"scale buffer of {buf[0].numel()} bytes per expert, expected {mp}x{kp}")
    x = buf.view(torch.uint8) if buf.dtype != torch.uint8 else buf
    x = x.reshape(e, mp // 128, kp // 4, 32, 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(e, mp, kp)
    return x[:, :m, :k].contiguous().view(buf.dtype)
