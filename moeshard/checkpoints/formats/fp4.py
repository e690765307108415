"""FP4 codecs: E2M1 values with MXFP4 (UE8M0) or NVFP4 (E4M3) block scales.

Pure torch, CPU or CUDA. Packed FP4 follows the checkpoints and FlashInfer: two values per
uint8, the low nibble holds the even element. Logical shape ``[..., K]`` is stored as
``[..., K // 2]`` uint8.
"""

from __future__ import annotations

import functools

import torch

#: E2M1 value of each 4-bit code (bit 3 = sign); the table of transformers' and openai's decoders.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0


@functools.cache
def _pairs(device: torch.device) -> torch.Tensor:
    """``[256, 2]`` float32: the two E2M1 values of each packed byte, low nibble first."""
    e2m1 = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    b = torch.arange(256)
    return torch.stack((e2m1[b & 0x0F], e2m1[b >> 4]), dim=-1).to(device)


@functools.cache
def _block_table(device: torch.device, scale_kind: str) -> torch.Tensor:
    """``[65536, 2]`` float32, indexed by ``scale byte << 8 | packed byte``: the byte's two values
    times the block scale, exact in float32 (a UE8M0 power of two, ``2 ** (s - 127)``, 255 NaN as
    in OCP MX; or an E4M3 value: at most 6 significant bits in the product)."""
    codes = torch.arange(256, dtype=torch.uint8)
    if scale_kind == "ue8m0":
        scale = torch.ldexp(torch.ones(256), torch.arange(256) - 127)
        scale[255] = float("nan")
    else:
        scale = codes.view(torch.float8_e4m3fn).float()
    return (scale.view(256, 1, 1) * _pairs(torch.device("cpu")).view(1, 256, 2)).reshape(65536, 2).to(device)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Decode packed E2M1 ``[..., K // 2]`` uint8 into float32 values ``[..., K]``."""
    vals = _pairs(packed.device).index_select(0, packed.reshape(-1).int())
    return vals.view(*packed.shape[:-1], 2 * packed.shape[-1])


def _decode_blocks(packed: torch.Tensor, scales: torch.Tensor, scale_kind: str) -> torch.Tensor:
    """``packed [..., K // 2]`` uint8 under byte block scales ``[..., K // block]`` -> float32
    ``[..., K]``: one gather of two scaled values per packed byte."""
    scales = scales.view(torch.uint8)
    per_block = packed.shape[-1] // scales.shape[-1]
    idx = torch.empty(*scales.shape, per_block, dtype=torch.int32, device=packed.device)
    torch.add((scales.int() << 8).unsqueeze(-1), packed.reshape(*scales.shape, per_block), out=idx)
    vals = _block_table(packed.device, scale_kind).index_select(0, idx.flatten())
    return vals.view(*packed.shape[:-1], 2 * packed.shape[-1])


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
    return _decode_blocks(packed, scales, "ue8m0")


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


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor | float | None) -> torch.Tensor:
    """NVFP4 to float32: ``fp4 value * E4M3 block scale * weight_scale_2``.

    Parameters
    ----------
    packed : ``[..., K // 2]`` uint8
    scales : ``[..., K // 16]`` float8_e4m3fn (or its uint8 bytes)
    scale_2 : float32 scalar, or ``[E]`` broadcast over the leading expert dim; None: left out
        (the caller applies it).
    """
    out = _decode_blocks(packed, scales, "e4m3")
    if scale_2 is None:
        return out
    s2 = torch.as_tensor(scale_2, dtype=torch.float32, device=out.device)
    if s2.dim() == 1:
        s2 = s2.view(-1, *([1] * (out.dim() - 1)))
    return out.mul_(s2)


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
