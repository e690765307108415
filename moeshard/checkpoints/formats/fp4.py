"""FP4 codecs: E2M1 values with MXFP4 (UE8M0) or NVFP4 (E4M3) block scales.

Pure torch, CPU or CUDA. Packed FP4 follows the checkpoints and FlashInfer: two values per
uint8, the low nibble holds the even element. Logical shape ``[..., K]`` is stored as
``[..., K // 2]`` uint8.
"""

from __future__ import annotations

import torch

#: E2M1 value of each 4-bit code (bit 3 = sign); the table of transformers' and openai's decoders.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0


def _lut(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Decode packed E2M1 ``[..., K // 2]`` uint8 into float32 values ``[..., K]``."""
    lut = _lut(packed.device)
    lo = lut[(packed & 0x0F).long()]
    hi = lut[(packed >> 4).long()]
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def quantize_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float ``[..., K]`` (already divided by its scale) to E2M1 codes, packed ``[..., K//2]``.

    Round to nearest, ties to even code, saturating at +-6 (what ModelOpt's and the OCP MX
    reference quantizers do).
    """
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must be even, found {x.shape[-1]}")
    a = x.float().abs()
    # Decision bounds between the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; ">" at a bound rounds a
    # tie down, ">=" up, so that every tie lands on the even code.
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for bound, up in ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)):
        code += (a >= bound) if up else (a > bound)
    code |= ((x < 0) & (code > 0)).to(torch.uint8) << 3
    return code[..., 0::2] | (code[..., 1::2] << 4)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 to float32.

    Parameters
    ----------
    packed : ``[..., K // 2]`` uint8
    scales : ``[..., K // 32]`` uint8, UE8M0 biased exponents (value = 2 ** (s - 127)).

    Returns
    -------
    ``[..., K]`` float32
    """
    vals = unpack_fp4(packed)
    exp = scales.to(torch.int32) - 127
    vals = vals.unflatten(-1, (scales.shape[-1], MXFP4_BLOCK))
    return torch.ldexp(vals, exp.unsqueeze(-1)).flatten(-2)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float ``[..., K]`` to MXFP4 (OCP MX: scale exponent = floor(log2(amax)) - 2).

    Returns ``(packed [..., K // 2] uint8, scales [..., K // 32] uint8)``; scales avoid the
    codes 0 and 255.
    """
    blocks = w.float().unflatten(-1, (w.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK))
    amax = blocks.abs().amax(-1).clamp(min=2.0**-100)
    exp = torch.floor(torch.log2(amax)) - 2
    exp = exp.clamp(-126, 127)
    scaled = blocks / torch.exp2(exp).unsqueeze(-1)
    packed = quantize_e2m1(scaled.flatten(-2))
    return packed, (exp + 127).to(torch.uint8)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor | float) -> torch.Tensor:
    """NVFP4 to float32: ``fp4 value * E4M3 block scale * weight_scale_2``.

    Parameters
    ----------
    packed : ``[..., K // 2]`` uint8
    scales : ``[..., K // 16]`` float8_e4m3fn (or its uint8 bytes)
    scale_2 : float32 scalar, or ``[E]`` broadcast over the leading expert dim.
    """
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    vals = unpack_fp4(packed).unflatten(-1, (scales.shape[-1], NVFP4_BLOCK))
    out = (vals * scales.float().unsqueeze(-1)).flatten(-2)
    s2 = torch.as_tensor(scale_2, dtype=torch.float32, device=out.device)
    if s2.dim() == 1:
        s2 = s2.view(-1, *([1] * (out.dim() - 1)))
    return out * s2


def quantize_nvfp4(w: torch.Tensor, scale_2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize float ``[N, K]`` to NVFP4 the way ModelOpt exports it.

    ``weight_scale_2 = amax(w) / (6 * 448)`` unless given (ModelOpt shares one between gate and
    up); block scale = ``amax(block) / 6 / weight_scale_2`` rounded to E4M3; values rounded to
    nearest even E2M1.

    Returns ``(packed [N, K // 2] uint8, weight_scale [N, K // 16] float8_e4m3fn,
    weight_scale_2 [] float32)``.
    """
    w = w.float()
    if scale_2 is None:
        scale_2 = (w.abs().amax() / (E2M1_MAX * E4M3_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    scale_2 = torch.as_tensor(scale_2, dtype=torch.float32)
    blocks = w.unflatten(-1, (w.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK))
    bscale = (blocks.abs().amax(-1) / E2M1_MAX / scale_2).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = bscale.float() * scale_2
    scaled = torch.where(denom.unsqueeze(-1) > 0, blocks / denom.unsqueeze(-1).clamp(min=1e-30), 0.0)
    return quantize_e2m1(scaled.flatten(-2)), bscale, scale_2
