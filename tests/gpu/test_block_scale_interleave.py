"""On a CUDA GPU: the CPU 128x4 interleave against FlashInfer's CUDA ``block_scale_interleave``.

Run on the device machine: ``make test-gpu`` (or ``pytest tests/gpu``). Not part of the CPU suite.
"""

from __future__ import annotations

import pytest
import torch

from moeshard.layouts.scales import interleave_scales_128x4

pytestmark = pytest.mark.gpu

#: Scale tensors of one real layer ([E, rows, cols] uint8) and awkward shapes that need padding.
SHAPES = {
    "gpt-oss-120b gemm1": (128, 6144, 96),
    "gpt-oss-120b gemm2": (128, 3072, 96),
    "deepseek-r1 gemm1": (256, 4096, 448),
    "deepseek-r1 gemm2": (256, 7168, 128),
    "llama4-scout gemm1": (16, 16384, 320),
    "llama4-scout gemm2": (16, 5120, 512),
    "awkward 200x7": (3, 200, 7),
    "awkward 31x3": (2, 31, 3),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_cpu_interleave_equals_flashinfer_cuda(name):
    from flashinfer import block_scale_interleave

    e, m, k = SHAPES[name]
    g = torch.Generator().manual_seed(e * m + k)
    sf = torch.randint(0, 256, (e, m, k), dtype=torch.uint8, generator=g)
    want = block_scale_interleave(sf.cuda()).cpu()
    got_cpu = interleave_scales_128x4(sf).flatten()
    got_cuda = interleave_scales_128x4(sf.cuda()).flatten().cpu()
    assert want.dtype == torch.uint8 and want.numel() == got_cpu.numel(), (want.shape, got_cpu.shape)
    assert torch.equal(got_cpu, want), name
    assert torch.equal(got_cuda, want), name


@pytest.mark.parametrize("ep_size", [1, 2])
def test_tiny_artifact_equals_vllm_with_cuda_interleave(gpt_oss_tiny, gpt_oss_artifacts, ep_size):
    """The whole vLLM preparation with FlashInfer's CUDA interleave, against the converted ranks."""
    from _reference import vllm_gpt_oss_trtllm
    from flashinfer import block_scale_interleave

    from moeshard.artifact.manifest import read_manifest
    from moeshard.checkpoints.source import Checkpoint

    out = gpt_oss_artifacts(ep_size)
    m = read_manifest(out)
    h_pad, i_pad = m["padding"]["hidden_size_padded"], m["padding"]["intermediate_size_padded"]
    cuda_interleave = lambda s: block_scale_interleave(s.contiguous().cuda()).cpu()  # noqa: E731
    with Checkpoint(gpt_oss_tiny) as src:
        for rank in m["ranks"]:
            e0, e1 = rank["experts"][0], rank["experts"][-1] + 1
            with Checkpoint(out / rank["folder"], with_config=False) as rf:
                for layer in m["moe_layers"]:
                    p = layer["prefix"]
                    rd = lambda leaf: src.read(f"{p}.{leaf}", e0, e1)  # noqa: E731
                    want = vllm_gpt_oss_trtllm(rd("gate_up_proj_blocks"), rd("gate_up_proj_scales"),
                                               rd("gate_up_proj_bias"), rd("down_proj_blocks"),
                                               rd("down_proj_scales"), rd("down_proj_bias"), h_pad, i_pad,
                                               interleave=cuda_interleave)
                    for leaf, t in want.items():
                        got = rf.read(f"{p}.{leaf}")
                        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), (rank["rank"], p, leaf)
