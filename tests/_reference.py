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
                        interleave=interleave_formula, cache: dict | None = None) -> dict[str, torch.Tensor]:
    """vLLM's GPT-OSS MXFP4 -> trtllm-gen preparation (``Mxfp4MoEMethod`` /
    ``convert_to_mxfp4_moe_kernel_format``), one expert at a time, with FlashInfer's helpers.

    Inputs are one rank's checkpoint slices: ``gate_up_proj_blocks [E, 2I, H/32, 16]`` U8 and so on.
    Padding as ``create_weights`` does it: zero params of the padded shape, checkpoint copied into
    the top-left corner; biases bf16 -> f32; pairwise row swap of w13, its scale and bias; then
    per expert ``get_w2_permute_indices_with_cache`` (epilogue_tile_m=128) on weights, scales
    (num_elts_per_sf=16, as vLLM passes) and biases, and the 128x4 interleave on the scales.
    Runs on the inputs' device; ``cache`` is the index cache (a fresh one by default).
    """
    from flashinfer.fused_moe.core import get_w2_permute_indices_with_cache

    e, two_i = blocks13.shape[:2]
    h = blocks2.shape[1]
    zeros = lambda *shape, dtype=torch.uint8: torch.zeros(*shape, dtype=dtype, device=blocks13.device)  # noqa: E731
    w13, s13, b13 = zeros(e, 2 * i_pad, h_pad // 2), zeros(e, 2 * i_pad, h_pad // 32), zeros(e, 2 * i_pad, dtype=torch.float32)
    w2, s2, b2 = zeros(e, h_pad, i_pad // 2), zeros(e, h_pad, i_pad // 32), zeros(e, h_pad, dtype=torch.float32)
    w13[:, :two_i, : blocks13.shape[2] * 16] = blocks13.flatten(-2)
    s13[:, :two_i, : scales13.shape[2]] = scales13
    b13[:, :two_i] = bias13.float()
    w2[:, :h, : blocks2.shape[2] * 16] = blocks2.flatten(-2)
    s2[:, :h, : scales2.shape[2]] = scales2
    b2[:, :h] = bias2.float()
    w13, s13, b13 = swap_every_two_rows(w13, -2), swap_every_two_rows(s13, -2), swap_every_two_rows(b13, -1)

    cache = {} if cache is None else cache
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


def vllm_nvfp4_trtllm(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                      w13_scale_2: torch.Tensor, w2_scale_2: torch.Tensor, a13: torch.Tensor, a2: torch.Tensor,
                      interleave=interleave_formula) -> dict[str, torch.Tensor]:
    """vLLM's ModelOpt NVFP4 -> trtllm-gen preparation (``prepare_static_weights_for_trtllm_fp4_moe``
    and the scale math of ``ModelOptNvFp4FusedMoE.process_weights_after_loading``), per expert.

    Inputs: one rank's experts after vLLM's ``reorder_w1w3_to_w3w1`` (rows ``[w3 ; w1]``) and
    after any zero padding: ``w13 [E, 2I, H/2]`` uint8, ``s13 [E, 2I, H/16]`` uint8 (E4M3 bytes),
    ``w2 [E, H, I/2]``, ``s2 [E, H, I/16]``; ``w13_scale_2``/``w2_scale_2`` ``[E]``; ``a13``,
    ``a2`` the layer's maxima of input_scale over all experts.
    """
    from flashinfer.fused_moe.core import _maybe_get_cached_w3_w1_permute_indices, get_w2_permute_indices_with_cache

    cache: dict = {}
    g1w, g1s, g2w, g2s = [], [], [], []
    e, two_i, hh = w13.shape
    for i in range(e):
        idx = _maybe_get_cached_w3_w1_permute_indices(cache, w13[i], 128)
        g1w.append(w13[i][idx].contiguous())
        idx = _maybe_get_cached_w3_w1_permute_indices(cache, s13[i], 128, num_elts_per_sf=16)
        g1s.append(interleave(s13[i][idx].contiguous()))
        idx = get_w2_permute_indices_with_cache(cache, w2[i], 128)
        g2w.append(w2[i][idx].contiguous())
        idx = get_w2_permute_indices_with_cache(cache, s2[i], 128, num_elts_per_sf=16)
        g2s.append(interleave(s2[i][idx].contiguous()))
    g1_alphas = (a13 * w13_scale_2).to(torch.float32)
    w2_input_scale_quant = (1 / a2).to(torch.float32)
    return {
        "gemm1_weights": torch.stack(g1w),
        "gemm1_weights_scale": torch.stack(g1s).view(torch.float8_e4m3fn).reshape(e, two_i, s13.shape[2]),
        "gemm2_weights": torch.stack(g2w),
        "gemm2_weights_scale": torch.stack(g2s).view(torch.float8_e4m3fn).reshape(e, w2.shape[1], s2.shape[2]),
        "output1_scale_gate_scalar": g1_alphas,
        "output1_scale_scalar": w2_input_scale_quant * g1_alphas,
        "output2_scale_scalar": (a2 * w2_scale_2).to(torch.float32),
        "hidden_states_scale_global": (1 / a13).to(torch.float32),
    }


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
