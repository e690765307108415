"""Canonical experts <-> the FP4 layout of FlashInfer's trtllm-gen fused MoE.

Per expert, with ``epilogue_tile_m = 128`` (DESIGN.md, "trtllm-gen FP4 layout"):

- ``gemm1_weights``: w13 rows permuted by the gated-activation reorder (out[2k] = up k,
  out[2k+1] = gate k) followed by the row shuffle (out[32b + j] = in[32b + 4*(j%8) + j//8]);
- ``gemm1_weights_scale``: w13_scale rows by the same permutation, then the 128x4 interleave,
  labelled float8_e4m3fn (also MXFP4's UE8M0 bytes: the kernel infers the format from the size);
- ``gemm1_bias``: w13_bias by the same permutation, float32;
- ``gemm2_*``: the same without the gated reorder.

The row permutations come from FlashInfer's own index functions
(``get_reorder_rows_for_gated_act_gemm_row_indices``, ``get_shuffle_matrix_a_row_indices``),
composed once per shape and applied to all experts of a layer in one gather.
"""

from __future__ import annotations

import functools

import torch

from moeshard.layouts.canonical import CanonicalExperts
from moeshard.layouts.scales import deinterleave_scales_128x4, interleave_scales_128x4

LAYOUT_NAME = "trtllm-gen-fp4"
LAYOUT_VERSION = 1
EPILOGUE_TILE_M = 128
SCALE_DTYPE = torch.float8_e4m3fn

#: GPT-OSS SwiGLU constants (alpha is hard-coded in the reference code, not in config.json).
GPT_OSS_SWIGLU_ALPHA = 1.702
GPT_OSS_SWIGLU_BETA = 1.0


@functools.lru_cache(maxsize=64)
def _row_permutation(rows: int, epilogue_tile_m: int, gated: bool) -> torch.Tensor:
    # FlashInfer's helpers only read the shape of their argument; a [rows, 1] stand-in suffices.
    try:
        from flashinfer.fused_moe.core import get_reorder_rows_for_gated_act_gemm_row_indices
        from flashinfer.utils import get_shuffle_matrix_a_row_indices
    except ImportError as e:
        from moeshard.errors import MoeshardError

        raise MoeshardError(f"the trtllm-gen layout uses FlashInfer's index functions, which did not import ({e}): "
                            "pip install flashinfer-python==0.7.2.post1 (on a CPU-only machine add --no-deps, then "
                            "apache-tvm-ffi and the small packages the Makefile lists)") from None

    probe = torch.empty(rows, 1, dtype=torch.uint8)
    shuffle = get_shuffle_matrix_a_row_indices(probe, epilogue_tile_m=epilogue_tile_m)
    if not gated:
        return shuffle
    # Same composition as FlashInfer's _maybe_get_cached_w3_w1_permute_indices: reorder, then shuffle.
    return get_reorder_rows_for_gated_act_gemm_row_indices(probe)[shuffle]


def gemm1_row_permutation(rows: int, epilogue_tile_m: int = EPILOGUE_TILE_M) -> torch.Tensor:
    """Row gather indices ``[rows]`` int64 for GEMM1 (``[up ; gate]`` rows, gated activation).

    ``out = w13[:, perm]``. Requires ``rows % 2 == 0`` and ``rows % 32 == 0`` (tile 128).
    Cached by ``(rows, epilogue_tile_m)``; callers must not modify the result.
    """
    return _row_permutation(rows, epilogue_tile_m, True)


def gemm2_row_permutation(rows: int, epilogue_tile_m: int = EPILOGUE_TILE_M) -> torch.Tensor:
    """Row gather indices ``[rows]`` int64 for GEMM2 (plain shuffle)."""
    return _row_permutation(rows, epilogue_tile_m, False)


def _gather_rows(t: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    return torch.index_select(t, 1, perm.to(t.device))


def to_trtllm(c: CanonicalExperts, epilogue_tile_m: int = EPILOGUE_TILE_M) -> dict[str, torch.Tensor]:
    """Rewrite (already padded) canonical experts into the trtllm-gen kernel tensors.

    Parameters
    ----------
    c : canonical experts with ``2*I % 128 == 0``, ``H % 128 == 0`` and ``H // sf``,
        ``I // sf`` multiples of 4, so that the 128x4 interleave adds no padding.

    Returns
    -------
    dict with ``gemm1_weights [E, 2*I, H // 2]`` uint8, ``gemm1_weights_scale [E, 2*I, H // sf]``
    float8_e4m3fn, ``gemm2_weights [E, H, I // 2]`` uint8, ``gemm2_weights_scale [E, H, I // sf]``
    float8_e4m3fn and, when c has biases, ``gemm1_bias [E, 2*I]`` / ``gemm2_bias [E, H]``
    float32. All new tensors on c's device.
    """
    e, two_i, _ = c.w13.shape
    h = c.hidden_size
    for name, (rows, cols) in {"w13_scale": c.w13_scale.shape[1:], "w2_scale": c.w2_scale.shape[1:]}.items():
        if rows % 128 or cols % 4:
            raise ValueError(f"{name} [{rows}, {cols}] needs rows % 128 == 0 and cols % 4 == 0; pad first")
    p1 = gemm1_row_permutation(two_i, epilogue_tile_m)
    p2 = gemm2_row_permutation(h, epilogue_tile_m)
    out = {
        "gemm1_weights": _gather_rows(c.w13, p1),
        "gemm1_weights_scale": interleave_scales_128x4(_gather_rows(c.w13_scale, p1)).view(SCALE_DTYPE),
        "gemm2_weights": _gather_rows(c.w2, p2),
        "gemm2_weights_scale": interleave_scales_128x4(_gather_rows(c.w2_scale, p2)).view(SCALE_DTYPE),
    }
    if c.w13_bias is not None:
        out["gemm1_bias"] = _gather_rows(c.w13_bias.float(), p1)
    if c.w2_bias is not None:
        out["gemm2_bias"] = _gather_rows(c.w2_bias.float(), p2)
    return out


def _padded_rows(i: int, i_pad: int, perm: torch.Tensor) -> torch.Tensor:
    """For each output row of GEMM1 (permutation ``perm`` of the padded ``[up ; gate]`` rows),
    the source row of the unpadded ``[up ; gate]`` (2*i rows), or 2*i (a zero row) for padding."""
    r = torch.arange(2 * i_pad)
    half, k = r // i_pad, r % i_pad
    src = torch.where(k < i, half * i + k, 2 * i)
    return src[perm]


def to_trtllm_padded(c: CanonicalExperts, hidden_pad: int, inter_pad: int,
                     epilogue_tile_m: int = EPILOGUE_TILE_M) -> dict[str, torch.Tensor]:
    """``to_trtllm(pad_experts(c, hidden_pad, inter_pad))`` with half the memory traffic.

    Padding and permutation are composed into one row map per tensor: the input gets one zero
    row and its padded columns in one copy, and one gather writes the kernel layout. Same
    outputs, same preconditions as the two functions it fuses.
    """
    e, two_i, _ = c.w13.shape
    i, h, sf = two_i // 2, c.hidden_size, c.sf_vec_size
    if hidden_pad < h or inter_pad < i or hidden_pad % sf or inter_pad % sf:
        raise ValueError(f"cannot pad H={h}, I={i} to {hidden_pad}, {inter_pad} (block {sf})")
    rows1 = _padded_rows(i, inter_pad, gemm1_row_permutation(2 * inter_pad, epilogue_tile_m))
    p2 = gemm2_row_permutation(hidden_pad, epilogue_tile_m)
    rows2 = torch.where(p2 < h, p2, h)

    def g1(t: torch.Tensor, cols: int) -> torch.Tensor:
        pad = [0, cols - t.shape[2], 0, 1] if t.dim() == 3 else [0, 1]
        return _gather_rows(torch.nn.functional.pad(t, pad), rows1)

    def g2(t: torch.Tensor, cols: int | None) -> torch.Tensor:
        pad = [0, cols - t.shape[2], 0, 1] if t.dim() == 3 else [0, 1]
        return _gather_rows(torch.nn.functional.pad(t, pad), rows2)

    s1, s2 = g1(c.w13_scale, hidden_pad // sf), g2(c.w2_scale, inter_pad // sf)
    for name, t in (("w13_scale", s1), ("w2_scale", s2)):
        if t.shape[1] % 128 or t.shape[2] % 4:
            raise ValueError(f"{name} [{t.shape[1]}, {t.shape[2]}] needs rows % 128 == 0 and cols % 4 == 0")
    out = {
        "gemm1_weights": g1(c.w13, hidden_pad // 2),
        "gemm1_weights_scale": interleave_scales_128x4(s1).view(SCALE_DTYPE),
        "gemm2_weights": g2(c.w2, inter_pad // 2),
        "gemm2_weights_scale": interleave_scales_128x4(s2).view(SCALE_DTYPE),
    }
    if c.w13_bias is not None:
        out["gemm1_bias"] = g1(c.w13_bias.float(), 0)
    if c.w2_bias is not None:
        out["gemm2_bias"] = g2(c.w2_bias.float(), None)
    return out


def from_trtllm(t: dict[str, torch.Tensor], epilogue_tile_m: int = EPILOGUE_TILE_M) -> CanonicalExperts:
    """Read kernel tensors back the way the kernel does: inverse interleave, inverse permutation.

    The inverse of :func:`to_trtllm` (padded canonical experts). For NVFP4, also the inverse of
    :func:`nvfp4_scalars`: ``w13_scale_2``, ``w2_scale_2`` and the input scales ``[E]`` float32
    that the kernel scalars imply.
    """
    w1, w2 = t["gemm1_weights"], t["gemm2_weights"]
    two_i, h = w1.shape[1], w2.shape[1]
    inv1 = torch.argsort(gemm1_row_permutation(two_i, epilogue_tile_m))
    inv2 = torch.argsort(gemm2_row_permutation(h, epilogue_tile_m))
    s1, s2 = t["gemm1_weights_scale"], t["gemm2_weights_scale"]
    s1 = deinterleave_scales_128x4(s1.view(torch.uint8), s1.shape[1], s1.shape[2])
    s2 = deinterleave_scales_128x4(s2.view(torch.uint8), s2.shape[1], s2.shape[2])
    b1, b2 = t.get("gemm1_bias"), t.get("gemm2_bias")
    c = CanonicalExperts(
        w13=_gather_rows(w1.view(torch.uint8), inv1),
        w13_scale=_gather_rows(s1, inv1),
        w2=_gather_rows(w2.view(torch.uint8), inv2),
        w2_scale=_gather_rows(s2, inv2),
        w13_bias=None if b1 is None else _gather_rows(b1, inv1),
        w2_bias=None if b2 is None else _gather_rows(b2, inv2),
    )
    if "output1_scale_gate_scalar" not in t:
        return c
    # NVFP4: undo nvfp4_scalars. The kernel's dequantization factors are all that matter, so
    # the effective weight_scale_2 is whatever the stored scalars imply (exact up to rounding).
    gate, o1, o2 = t["output1_scale_gate_scalar"], t["output1_scale_scalar"], t["output2_scale_scalar"]
    a13 = 1.0 / t["hidden_states_scale_global"].float()
    a2 = gate / o1
    return c.replace(w13_scale_2=gate / a13, w2_scale_2=o2 / a2, w13_input_scale=a13.expand_as(gate), w2_input_scale=a2)


def swiglu_oai_scalars(num_experts: int, limit: float, alpha: float = GPT_OSS_SWIGLU_ALPHA,
                       beta: float = GPT_OSS_SWIGLU_BETA) -> dict[str, torch.Tensor]:
    """``gemm1_alpha``, ``gemm1_beta``, ``gemm1_clamp_limit``: float32 ``[E]`` each (GPT-OSS)."""
    full = lambda v: torch.full((num_experts,), v, dtype=torch.float32)  # noqa: E731
    return {"gemm1_alpha": full(alpha), "gemm1_beta": full(beta), "gemm1_clamp_limit": full(limit)}


def nvfp4_scalars(w13_scale_2: torch.Tensor, w2_scale_2: torch.Tensor, a13: torch.Tensor,
                  a2: torch.Tensor) -> dict[str, torch.Tensor]:
    """Kernel scalars of an NVFP4 x NVFP4 layer, as vLLM's ModelOpt NVFP4 trtllm path computes them.

    Parameters
    ----------
    w13_scale_2, w2_scale_2 : ``[E]`` float32, the local experts' ``weight_scale_2``
    a13, a2 : ``[]`` float32, maxima of the GEMM1 / GEMM2 ``input_scale`` over ALL experts of
        the layer (so identical on every rank)

    Returns
    -------
    ``output1_scale_gate_scalar = a13 * w13_scale_2``, ``output1_scale_scalar =
    output1_scale_gate_scalar * (1 / a2)``, ``output2_scale_scalar = a2 * w2_scale_2`` (float32
    ``[E]``), and ``hidden_states_scale_global = 1 / a13`` (float32 ``[]``), the global scale
    to quantize the hidden states with. Multiplying by ``1 / a2`` (not dividing by a2) is
    vLLM's ``g1_scale_c = w2_input_scale_quant * g1_alphas``; the two differ by at most one ulp.
    """
    a13, a2 = a13.float(), a2.float()
    gate = (a13 * w13_scale_2.float()).float()
    return {
        "output1_scale_gate_scalar": gate,
        "output1_scale_scalar": (1.0 / a2) * gate,
        "output2_scale_scalar": (a2 * w2_scale_2.float()).float(),
        "hidden_states_scale_global": (1.0 / a13).reshape(()),
    }
