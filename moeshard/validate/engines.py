"""The preparation serving engines run today, one expert at a time with FlashInfer's own helpers
(vLLM's arithmetic): the baseline the benchmarks measure against and an oracle that shares none
of moeshard's layout code (it never imports :mod:`moeshard.layouts` for the permutations).
"""

from __future__ import annotations

import torch


def engine_interleave(sf: torch.Tensor) -> torch.Tensor:
    """One expert's 128x4 scale interleave as an engine runs it: FlashInfer's CUDA
    ``block_scale_interleave`` on a CUDA tensor; elsewhere moeshard's CPU twin, proven
    byte-identical to it on the GPU (``tests/gpu/test_block_scale_interleave.py``)."""
    if sf.is_cuda:
        from flashinfer import block_scale_interleave

        return block_scale_interleave(sf.contiguous())
    from moeshard.layouts.scales import interleave_scales_128x4

    return interleave_scales_128x4(sf.unsqueeze(0)).flatten()


def flashinfer_layout(c, interleave=None, cache: dict | None = None) -> dict[str, torch.Tensor]:
    """The kernel tensors of one expert as an engine prepares them with FlashInfer's own helpers:
    ``_maybe_get_cached_w3_w1_permute_indices`` (gated reorder, then row shuffle) on GEMM1's
    weights, scales (``num_elts_per_sf=16``, as vLLM passes it for both formats) and bias,
    ``get_w2_permute_indices_with_cache`` (row shuffle) on GEMM2's, epilogue_tile_m 128, then the
    128x4 interleave of the scales (:func:`engine_interleave`).

    ``c``: one expert's padded canonical tensors (a :class:`~moeshard.layouts.canonical.
    CanonicalExperts` of one: ``w13 [1, 2*I, H/2]`` rows ``[up ; gate]``, ...). Returns ``[1, ...]``
    tensors named as the artifact's (scales as float8_e4m3fn). Shares none of moeshard's
    permutation code: the layout check of ``moeshard validate``.
    """
    from flashinfer.fused_moe.core import _maybe_get_cached_w3_w1_permute_indices, get_w2_permute_indices_with_cache

    interleave, cache = interleave or engine_interleave, {} if cache is None else cache
    g1 = lambda t, **kw: t[_maybe_get_cached_w3_w1_permute_indices(cache, t, 128, **kw).to(t.device)]  # noqa: E731
    g2 = lambda t, **kw: t[get_w2_permute_indices_with_cache(cache, t, 128, **kw).to(t.device)]  # noqa: E731
    w13, s13, w2, s2 = c.w13[0], c.w13_scale[0].view(torch.uint8), c.w2[0], c.w2_scale[0].view(torch.uint8)
    out = {"gemm1_weights": g1(w13), "gemm2_weights": g2(w2),
           "gemm1_weights_scale": interleave(g1(s13, num_elts_per_sf=16).contiguous()).reshape(s13.shape),
           "gemm2_weights_scale": interleave(g2(s2, num_elts_per_sf=16).contiguous()).reshape(s2.shape)}
    out["gemm1_weights_scale"] = out["gemm1_weights_scale"].view(torch.float8_e4m3fn)
    out["gemm2_weights_scale"] = out["gemm2_weights_scale"].view(torch.float8_e4m3fn)
    if c.w13_bias is not None:
        out["gemm1_bias"] = g1(c.w13_bias[0].float().reshape(-1, 1)).reshape(-1)
        out["gemm2_bias"] = g2(c.w2_bias[0].float().reshape(-1, 1)).reshape(-1)
    return {k: v.unsqueeze(0) for k, v in out.items()}


def swap_every_two_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """vLLM's ``swap_every_two_rows``: rows 2k <-> 2k+1 along ``dim``."""
    shape = x.shape
    dim = dim % x.dim()
    x = x.reshape(*shape[:dim], shape[dim] // 2, 2, *shape[dim + 1:])
    return x.flip(dim + 1).reshape(shape)


def vllm_gpt_oss_trtllm(blocks13, scales13, bias13, blocks2, scales2, bias2, h_pad: int, i_pad: int,
                        interleave=None, cache: dict | None = None) -> dict[str, torch.Tensor]:
    """vLLM's GPT-OSS MXFP4 -> trtllm-gen preparation (``Mxfp4MoEMethod`` /
    ``convert_to_mxfp4_moe_kernel_format``), one expert at a time, with FlashInfer's helpers.

    Inputs are one rank's checkpoint slices: ``gate_up_proj_blocks [E, 2I, H/32, 16]`` U8 and so on.
    Padding as ``create_weights`` does it: zero params of the padded shape, checkpoint copied into
    the top-left corner; biases bf16 -> f32; pairwise row swap of w13, its scale and bias; then
    per expert ``get_w2_permute_indices_with_cache`` (epilogue_tile_m=128) on weights, scales
    (num_elts_per_sf=16, as vLLM passes) and biases, and the 128x4 interleave on the scales.
    Runs on the inputs' device; ``cache`` is the index cache (a fresh one by default);
    ``interleave`` one expert's 128x4 scale interleave (default: :func:`engine_interleave`).
    """
    from flashinfer.fused_moe.core import get_w2_permute_indices_with_cache

    interleave = interleave or engine_interleave

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
                      interleave=None, w3_scale_2: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """vLLM's ModelOpt NVFP4 -> trtllm-gen preparation (``prepare_static_weights_for_trtllm_fp4_moe``
    and the scale math of ``ModelOptNvFp4FusedMoE.process_weights_after_loading``), per expert.

    Inputs: one rank's experts after vLLM's ``reorder_w1w3_to_w3w1`` (rows ``[w3 ; w1]``) and
    after any zero padding: ``w13 [E, 2I, H/2]`` uint8, ``s13 [E, 2I, H/16]`` uint8 (E4M3 bytes),
    ``w2 [E, H, I/2]``, ``s2 [E, H, I/16]``; ``w13_scale_2``/``w2_scale_2`` ``[E]``; ``a13``,
    ``a2`` the layer's maxima of input_scale over all experts; ``interleave`` as for
    :func:`vllm_gpt_oss_trtllm`. ``w13_scale_2`` is gate's (vLLM takes column 0 for both
    halves); ``w3_scale_2``, when given, is up's, used for ``output1_scale_scalar`` as the exact
    fix does (TensorRT-LLM PR #18772: ``g1_scale_c = w2_input_scale_quant * a13 * up_scale_2``).
    """
    from flashinfer.fused_moe.core import _maybe_get_cached_w3_w1_permute_indices, get_w2_permute_indices_with_cache

    interleave = interleave or engine_interleave

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
        "output1_scale_scalar": (w2_input_scale_quant * g1_alphas if w3_scale_2 is None else
                                 w2_input_scale_quant * (a13 * w3_scale_2).to(torch.float32)),
        "output2_scale_scalar": (a2 * w2_scale_2).to(torch.float32),
        "hidden_states_scale_global": (1 / a13).to(torch.float32),
    }
