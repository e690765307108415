"""Independent oracles, kept in one place: what the tests compare moeshard against.

Nothing here imports moeshard.layouts: the oracles are FlashInfer's own helpers applied the
way vLLM applies them, and the 128x4 layout written out from its formula.
"""

from __future__ import annotations

import torch


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


def swap_every_two_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """vLLM's ``swap_every_two_rows``: rows 2k <-> 2k+1 along ``dim``."""
    shape = x.shape
    dim = dim % x.dim()
    x = x.reshape(*shape[:dim], shape[dim] // 2, 2, *shape[dim + 1:])
    return x.flip(dim + 1).reshape(shape)


def vllm_gpt_oss_trtllm(blocks13, scales13, bias13, blocks2, scales2, bias2, h_pad: int, i_pad: int,
                        interleave=interleave_formula) -> dict[str, torch.Tensor]:
    """vLLM's GPT-OSS MXFP4 -> trtllm-gen preparation (``Mxfp4MoEMethod`` /
    ``convert_to_mxfp4_moe_kernel_format``), one expert at a time, with FlashInfer's helpers.

    Inputs are one rank's checkpoint slices: ``gate_up_proj_blocks [E, 2I, H/32, 16]`` U8 and so on.
    Padding as ``create_weights`` does it: zero params of the padded shape, checkpoint copied into
    the top-left corner; biases bf16 -> f32; pairwise row swap of w13, its scale and bias; then
    per expert ``get_w2_permute_indices_with_cache`` (epilogue_tile_m=128) on weights, scales
    (num_elts_per_sf=16, as vLLM passes) and biases, and the 128x4 interleave on the scales.
    """
    from flashinfer.fused_moe.core import get_w2_permute_indices_with_cache

    e, two_i = blocks13.shape[:2]
    h = blocks2.shape[1]
    w13 = torch.zeros(e, 2 * i_pad, h_pad // 2, dtype=torch.uint8)
    s13 = torch.zeros(e, 2 * i_pad, h_pad // 32, dtype=torch.uint8)
    b13 = torch.zeros(e, 2 * i_pad, dtype=torch.float32)
    w2 = torch.zeros(e, h_pad, i_pad // 2, dtype=torch.uint8)
    s2 = torch.zeros(e, h_pad, i_pad // 32, dtype=torch.uint8)
    b2 = torch.zeros(e, h_pad, dtype=torch.float32)
    w13[:, :two_i, : blocks13.shape[2] * 16] = blocks13.flatten(-2)
    s13[:, :two_i, : scales13.shape[2]] = scales13
    b13[:, :two_i] = bias13.float()
    w2[:, :h, : blocks2.shape[2] * 16] = blocks2.flatten(-2)
    s2[:, :h, : scales2.shape[2]] = scales2
    b2[:, :h] = bias2.float()
    w13, s13, b13 = swap_every_two_rows(w13, -2), swap_every_two_rows(s13, -2), swap_every_two_rows(b13, -1)

    cache: dict = {}
    out = {k: [] for k in ("gemm1_weights", "gemm1_weights_scale", "gemm1_bias",
                           "gemm2_weights", "gemm2_weights_scale", "gemm2_bias")}
    for i in range(e):
        idx = get_w2_permute_indices_with_cache(cache, w13[i], 128)
        out["gemm1_weights"].append(w13[i][idx])
        idx = get_w2_permute_indices_with_cache(cache, s13[i], 128, num_elts_per_sf=16)
        out["gemm1_weights_scale"].append(interleave(s13[i][idx]).reshape(2 * i_pad, h_pad // 32))
        idx = get_w2_permute_indices_with_cache(cache, b13[i].reshape(-1, 1), 128)
        out["gemm1_bias"].append(b13[i][idx])
        idx = get_w2_permute_indices_with_cache(cache, w2[i], 128)
        out["gemm2_weights"].append(w2[i][idx])
        idx = get_w2_permute_indices_with_cache(cache, s2[i], 128, num_elts_per_sf=16)
        out["gemm2_weights_scale"].append(interleave(s2[i][idx]).reshape(h_pad, i_pad // 32))
        idx = get_w2_permute_indices_with_cache(cache, b2[i].reshape(-1, 1), 128)
        out["gemm2_bias"].append(b2[i][idx])
    res = {k: torch.stack(v) for k, v in out.items()}
    res["gemm1_weights_scale"] = res["gemm1_weights_scale"].view(torch.float8_e4m3fn)
    res["gemm2_weights_scale"] = res["gemm2_weights_scale"].view(torch.float8_e4m3fn)
    return res
