"""Independent oracles, kept in one place: what the tests compare moeshard against.

Nothing here imports moeshard.layouts: the oracles are FlashInfer's own helpers applied the
way vLLM applies them (:mod:`moeshard.validate.engines`, here with the 128x4 layout written out
from its formula), and ModelOpt's NVFP4 decode written out.
"""

from __future__ import annotations

from functools import partial

import torch

from moeshard.validate import engines


def interleave_formula(sf: torch.Tensor) -> torch.Tensor:
    """128x4 swizzle of one expert's scales ``[M, K]`` from the formula alone, flat ``[Mp * Kp]``.

    Byte (m, k) of the zero-padded [Mp, Kp] matrix goes to
    ((m // 128 * Kp // 4 + k // 4) * 32 + m % 32) * 16 + (m % 128) // 32 * 4 + k % 4.
    """
    m, k = sf.shape
    mp, kp = -(-m // 128) * 128, -(-k // 4) * 4
    padded = torch.zeros(mp, kp, dtype=torch.uint8)
    padded[:m, :k] = sf.view(torch.uint8)
    mm = torch.arange(mp).view(-1, 1).expand(mp, kp)
    kk = torch.arange(kp).view(1, -1).expand(mp, kp)
    off = ((mm // 128 * (kp // 4) + kk // 4) * 32 + mm % 32) * 16 + (mm % 128) // 32 * 4 + kk % 4
    out = torch.full((mp * kp,), 0xFF, dtype=torch.uint8)  # 0xFF: any byte not written shows up
    out[off.flatten()] = padded.flatten()
    return out


#: vLLM's preparations with the formula's interleave (no moeshard layout code involved).
vllm_gpt_oss_trtllm = partial(engines.vllm_gpt_oss_trtllm, interleave=interleave_formula)
vllm_nvfp4_trtllm = partial(engines.vllm_nvfp4_trtllm, interleave=interleave_formula)
swap_every_two_rows = engines.swap_every_two_rows


def pad_w13(t: torch.Tensor, i_pad: int, k_pad: int) -> torch.Tensor:
    """Zero-pad ``[E, 2I, K]`` rows ``[a ; b]`` to ``[E, 2*i_pad, k_pad]`` (each half at its end)."""
    e, two_i, k = t.shape
    i = two_i // 2
    out = torch.zeros(e, 2 * i_pad, k_pad, dtype=t.dtype)
    out[:, :i, :k] = t[:, :i]
    out[:, i_pad:i_pad + i, :k] = t[:, i:]
    return out


def pad_2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros(t.shape[0], rows, cols, dtype=t.dtype)
    out[:, : t.shape[1], : t.shape[2]] = t
    return out


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def dequant_nvfp4_ref(w: torch.Tensor, s: torch.Tensor, s2) -> torch.Tensor:
    """ModelOpt's NVFP4 decode, written out: ``[N, K/2]`` uint8, ``[N, K/16]`` E4M3, scalar -> ``[N, K]`` f32.
    Element 2j is the low nibble of byte j; w[n, k] = e2m1 * float(weight_scale[n, k // 16]) * weight_scale_2."""
    lut = torch.tensor(E2M1)
    codes = torch.empty(w.shape[0], w.shape[1] * 2, dtype=torch.long)
    codes[:, 0::2] = (w & 0xF).long()
    codes[:, 1::2] = (w >> 4).long()
    scale = s.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
    return lut[codes] * scale * float(s2)
