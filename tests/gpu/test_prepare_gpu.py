"""On a CUDA GPU: FlashInfer's own ``prepare_trtllm_fp4_weights`` with its CUDA kernels against
moeshard's layout of the same FP4 codes.

NVFP4 runs unpatched: FlashInfer quantizes BF16 weights on the GPU, and moeshard lays out the codes
and scales the same ``fp4_quantize`` call gives. MXFP4 replaces only the quantizer (FlashInfer's
MXFP4 ``fp4_quantize`` gives all-zero codes on SM90, ``/work/shared/device.md``) by one handing back
given codes; the reorder, shuffle and CUDA ``block_scale_interleave`` stay FlashInfer's. Run on
the device machine: ``make test-gpu`` (or ``pytest tests/gpu``). Not part of the CPU suite.
"""

from __future__ import annotations

import pytest
import torch

from moeshard.layouts.canonical import CanonicalExperts
from moeshard.layouts.trtllm import to_trtllm

pytestmark = pytest.mark.gpu

LAYOUT = ("gemm1_weights", "gemm1_weights_scale", "gemm2_weights", "gemm2_weights_scale")
#: (E, H, I): small, a gpt-oss-120b expert pair (H and I padded to 3072), a DeepSeek-R1-like pair at EP 32
SHAPES = [(4, 512, 256), (2, 3072, 3072), (3, 7168, 256)]


def assert_same_layout(prepared: dict, ours: dict) -> None:
    for name in LAYOUT:
        a, b = prepared[name].cpu(), ours[name].cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


@pytest.mark.parametrize("e,h,i", SHAPES)
def test_nvfp4_unpatched(e, h, i):
    from flashinfer.fp4_quantization import fp4_quantize
    from flashinfer.fused_moe.api import QuantConfig, QuantFormat
    from flashinfer.fused_moe.prepare import prepare_trtllm_fp4_weights

    g = torch.Generator(device="cuda").manual_seed(e * h + i)
    w1 = torch.randn(e, 2 * i, h, device="cuda", generator=g).bfloat16()
    w2 = torch.randn(e, h, i, device="cuda", generator=g).bfloat16()
    prepared = prepare_trtllm_fp4_weights(w1, w2, quant=QuantConfig(weight=QuantFormat.NVFP4,
                                                                     activation=QuantFormat.NVFP4),
                                          num_local_experts=e, hidden_size=h, intermediate_size=i,
                                          device=torch.device("cuda"), permute_cache={})

    def codes(w):  # the call prepare_trtllm_fp4_weights makes (prepare.py), on the same BF16 rows
        q, s = fp4_quantize(w.reshape(-1, w.shape[2]), global_scale=torch.tensor([1.0], device="cuda"),
                            sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=False)
        return q.view(torch.uint8).reshape(*w.shape[:2], -1).cpu(), s.view(torch.uint8).reshape(*w.shape[:2], -1).cpu()

    (w13, s13), (w2q, s2) = codes(w1), codes(w2)
    assert w13.any() and s13.any(), "fp4_quantize gave no codes"
    c = CanonicalExperts(w13=w13, w13_scale=s13, w2=w2q, w2_scale=s2)
    assert_same_layout(prepared, to_trtllm(c))
    assert_same_layout(prepared, to_trtllm(c.replace(**{k: getattr(c, k).cuda() for k in ("w13", "w13_scale", "w2",
                                                                                           "w2_scale")})))


@pytest.mark.parametrize("e,h,i", SHAPES)
def test_mxfp4_quantizer_patched(e, h, i):
    from _reference import prepare_trtllm_fp4_with_codes

    g = torch.Generator().manual_seed(e * h + i)
    c = CanonicalExperts(w13=torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=g),
                         w13_scale=torch.randint(100, 140, (e, 2 * i, h // 32), dtype=torch.uint8, generator=g),
                         w2=torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=g),
                         w2_scale=torch.randint(100, 140, (e, h, i // 32), dtype=torch.uint8, generator=g))
    prepared = prepare_trtllm_fp4_with_codes(c.w13, c.w13_scale, c.w2, c.w2_scale, device="cuda")
    assert prepared["gemm1_weights"].is_cuda
    assert_same_layout(prepared, to_trtllm(c))


@pytest.mark.parametrize("family,ep_size,pad", [("gpt_oss_tiny", 2, 256), ("deepseek_tiny", 2, 256),
                                                ("llama4_tiny", 1, 256)])
def test_converted_ranks_equal_flashinfer_cuda_preparation(request, artifacts, family, ep_size, pad):
    """The CPU suite's ``prepare_trtllm_fp4_weights`` oracle with FlashInfer's CUDA interleave."""
    from test_prepare_oracle import assert_preparation_gives_the_rank_bytes

    assert_preparation_gives_the_rank_bytes(request.getfixturevalue(family), artifacts(family, ep_size, pad), "cuda")
