"""On a CUDA GPU: FlashInfer's own ``prepare_trtllm_fp4_weights`` with its CUDA kernels against
moeshard's layout of the same FP4 codes.

Only the quantizer is replaced, by one handing back given codes: on SM90 FlashInfer's
``fp4_quantize`` gives all-zero MXFP4 codes (``/work/shared/device.md``), and with the
``global_scale`` of 1.0 that ``prepare_trtllm_fp4_weights`` passes it gave all-zero NVFP4 block
scales on the H200 (2026-11-30), so neither can serve as the source of real codes there. The
reorder, shuffle and CUDA ``block_scale_interleave`` stay FlashInfer's. Run on
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


@pytest.mark.parametrize("sf", [32, 16])
@pytest.mark.parametrize("e,h,i", SHAPES)
def test_quantizer_patched(e, h, i, sf):
    """MXFP4 (sf 32, UE8M0 scales) and NVFP4 (sf 16, E4M3 scales) codes through FlashInfer's own
    preparation with its CUDA interleave."""
    from _reference import prepare_trtllm_fp4_with_codes

    g = torch.Generator().manual_seed(e * h + i + sf)
    lo, hi = (100, 140) if sf == 32 else (1, 0x7E)
    c = CanonicalExperts(w13=torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=g),
                         w13_scale=torch.randint(lo, hi, (e, 2 * i, h // sf), dtype=torch.uint8, generator=g),
                         w2=torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=g),
                         w2_scale=torch.randint(lo, hi, (e, h, i // sf), dtype=torch.uint8, generator=g))
    prepared = prepare_trtllm_fp4_with_codes(c.w13, c.w13_scale, c.w2, c.w2_scale, device="cuda")
    assert prepared["gemm1_weights"].is_cuda
    assert_same_layout(prepared, to_trtllm(c))
    assert_same_layout(prepared, to_trtllm(c.replace(**{k: getattr(c, k).cuda() for k in ("w13", "w13_scale", "w2",
                                                                                           "w2_scale")})))


@pytest.mark.parametrize("family,ep_size,pad", [("gpt_oss_tiny", 2, 256), ("deepseek_tiny", 2, 256),
                                                ("llama4_tiny", 1, 256)])
def test_converted_ranks_equal_flashinfer_cuda_preparation(request, artifacts, family, ep_size, pad):
    """The CPU suite's ``prepare_trtllm_fp4_weights`` oracle with FlashInfer's CUDA interleave."""
    from test_prepare_oracle import assert_preparation_gives_the_rank_bytes

    assert_preparation_gives_the_rank_bytes(request.getfixturevalue(family), artifacts(family, ep_size, pad), "cuda")
