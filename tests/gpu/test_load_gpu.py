"""On a CUDA GPU: load_rank's pinned, overlapped reads give the same tensors as the CPU path."""

from __future__ import annotations

import pytest
import torch

import moeshard

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["gpt_oss_tiny", "deepseek_tiny", "llama4_tiny"])
def test_cuda_load_equals_cpu_load(artifacts, family):
    out = artifacts(family, 2)
    for rank in (0, 1):
        cpu = moeshard.load_rank(out, rank, device="cpu")
        gpu = moeshard.load_rank(out, rank, device="cuda")
        for layer, lc in cpu.layers.items():
            for name, t in lc.tensors.items():
                g = gpu.layers[layer].tensors[name]
                assert g.is_cuda and g.dtype == t.dtype and g.shape == t.shape
                assert torch.equal(g.cpu().reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
