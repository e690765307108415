"""On a CUDA GPU: ``validate --device cuda`` (decode on the GPU, pinned read-ahead, the layout check
with FlashInfer's CUDA ``block_scale_interleave``) and the FP4 decode tables on CUDA."""

from __future__ import annotations

import pytest
import torch

from moeshard.checkpoints.formats.fp4 import dequantize_mxfp4, dequantize_nvfp4
from moeshard.convert.pipeline import convert
from moeshard.validate import validate

pytestmark = pytest.mark.gpu


def test_fp4_decode_on_cuda_equals_cpu():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (4, 256, 96), dtype=torch.uint8, generator=g)
    ue8m0 = torch.randint(0, 255, (4, 256, 6), dtype=torch.uint8, generator=g)
    e4m3 = torch.randint(0, 0x7F, (4, 256, 12), dtype=torch.uint8, generator=g)
    s2 = torch.rand(4, generator=g)
    assert torch.equal(dequantize_mxfp4(packed.cuda(), ue8m0.cuda()).cpu(), dequantize_mxfp4(packed, ue8m0))
    assert torch.equal(dequantize_nvfp4(packed.cuda(), e4m3.cuda(), s2.cuda()).cpu(), dequantize_nvfp4(packed, e4m3, s2))


@pytest.mark.parametrize("family", ["gpt_oss_tiny", "deepseek_tiny", "llama4_tiny"])
@pytest.mark.parametrize("layout", [{"ep_size": 2}, {"ep_size": 2, "tp_size": 2}, {"ep_size": 2, "placement": "round-robin"}])
def test_validate_on_cuda(request, tmp_path, family, layout):
    out = convert(request.getfixturevalue(family), tmp_path / "out", **layout).out
    cuda = validate(out, tokens=8, device="cuda", backend="decode", full=True)
    cpu = validate(out, tokens=8, device="cpu", backend="decode", full=True)
    assert cuda.passed and cpu.passed
    ranks = [r for r in cuda.rows if r.rank != "sum"]
    assert ranks and all(r.layout_checked == r.experts_checked > 0 for r in ranks)
    for a, b in zip(cuda.rows, cpu.rows):
        assert (a.rank, a.layer) == (b.rank, b.layer) and a.rel_error <= 1e-5 and b.rel_error <= 1e-5


def test_layout_check_on_cuda_catches_the_wrong_order(tmp_path, gpt_oss_tiny, deepseek_tiny, monkeypatch):
    """As the CPU test of the same name, with the expected layout rebuilt by FlashInfer's CUDA
    interleave: the decode passes, the layout check names gemm1_weights."""
    from moeshard.layouts import fingerprint, trtllm

    def wrong_order(rows, epilogue_tile_m, gated):
        from flashinfer.fused_moe.core import get_reorder_rows_for_gated_act_gemm_row_indices
        from flashinfer.utils import get_shuffle_matrix_a_row_indices

        probe = torch.empty(rows, 1, dtype=torch.uint8)
        shuffle = get_shuffle_matrix_a_row_indices(probe, epilogue_tile_m=epilogue_tile_m)
        return shuffle[get_reorder_rows_for_gated_act_gemm_row_indices(probe)] if gated else shuffle

    monkeypatch.setattr(trtllm, "_row_permutation", wrong_order)
    monkeypatch.setattr(fingerprint, "moeshard_indices", fingerprint.flashinfer_indices)  # convert's guard off
    for src in (gpt_oss_tiny, deepseek_tiny):
        out = convert(src, tmp_path / src.parent.name, ep_size=2).out
        report = validate(out, tokens=4, device="cuda", backend="decode")
        ranks = [r for r in report.rows if r.rank != "sum"]
        assert all(r.rel_error <= report.tolerance for r in ranks)
        assert not report.passed and all("layout check: expert" in r.detail and "gemm1_weights" in r.detail
                                         for r in ranks), [r.detail for r in ranks]
