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


def prepare_trtllm_fp4_with_codes(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                                  activation=None, device: str = "cpu") -> dict[str, torch.Tensor]:
    """FlashInfer's own ``prepare_trtllm_fp4_weights`` (``fused_moe/prepare.py``) on given FP4 codes:
    its ``fp4_quantize`` returns these codes and scales instead of quantizing its BF16 input; on
    the CPU its CUDA-only ``block_scale_interleave`` is the formula above (on CUDA it is its own).
    Everything else (gated reorder, row shuffle, per-expert loop, assembly, dtypes) is FlashInfer's.

    ``w13 [E, 2I, H/2]``, ``w13_scale [E, 2I, H/sf]``, ``w2 [E, H, I/2]``, ``w2_scale [E, H, I/sf]``
    uint8, canonical ``[up ; gate]`` rows, H and I as the kernel takes them (FlashInfer pads
    nothing); sf 32 means MXFP4 (BF16 activations), 16 NVFP4. Returns FlashInfer's dict, on ``device``.
    """
    import flashinfer.fp4_quantization as fp4_stub
    import flashinfer.quantization.fp4_quantization as fp4_module
    from flashinfer.fused_moe.api import QuantConfig, QuantFormat
    from flashinfer.fused_moe.prepare import prepare_trtllm_fp4_weights

    e, two_i, h2 = w13.shape
    h, i = 2 * h2, two_i // 2
    sf = h // w13_scale.shape[2]
    codes = [(w13, w13_scale), (w2, w2_scale)]

    def fp4_quantize(x, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True, **kw):
        w, s = codes.pop(0)  # called for w1, then w2, with their flattened BF16 rows
        assert tuple(x.shape) == (w.shape[0] * w.shape[1], 2 * w.shape[2]) and x.dtype == torch.bfloat16
        assert (sf_vec_size, sf_use_ue8m0, is_sf_swizzled_layout) == (sf, sf == 32, False) and not kw
        return w.reshape(-1, w.shape[2]).to(device), s.reshape(-1).to(device)

    real = (fp4_stub.fp4_quantize, fp4_module.block_scale_interleave)
    fp4_stub.fp4_quantize = fp4_quantize  # prepare imports it from this stub module at call time
    if device == "cpu":
        fp4_module.block_scale_interleave = interleave_formula
    try:
        quant = QuantConfig(weight=QuantFormat.MXFP4, activation=QuantFormat.BF16) if sf == 32 else \
            QuantConfig(weight=QuantFormat.NVFP4, activation=QuantFormat.NVFP4)
        out = prepare_trtllm_fp4_weights(torch.empty(e, two_i, h, dtype=torch.bfloat16),
                                         torch.empty(e, h, i, dtype=torch.bfloat16), quant=quant,
                                         num_local_experts=e, hidden_size=h, intermediate_size=i,
                                         activation=activation, device=torch.device(device), permute_cache={})
    finally:
        fp4_stub.fp4_quantize, fp4_module.block_scale_interleave = real
    assert not codes, "prepare_trtllm_fp4_weights quantized fewer tensors than expected"
    return out
