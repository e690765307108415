"""FlashInfer's own weight preparation, ``prepare_trtllm_fp4_weights``, as an oracle: run on the CPU
(its quantizer returns the checkpoint's codes, its CUDA interleave is the 128x4 formula; see
``_reference.prepare_trtllm_fp4_with_codes``), it must give the converted ranks' bytes, for MXFP4 and
NVFP4 and several numbers of experts and padded sizes. ``tests/gpu/test_prepare_gpu.py`` runs it
unpatched on CUDA."""

from __future__ import annotations

import pytest
import torch
from _reference import pad_2d, pad_w13, prepare_trtllm_fp4_with_codes

import moeshard
from moeshard.artifact.manifest import Manifest
from moeshard.checkpoints.families import detect, read_rank_experts
from moeshard.checkpoints.source import Checkpoint

LAYOUT = ("gemm1_weights", "gemm1_weights_scale", "gemm2_weights", "gemm2_weights_scale")


#: (fixture, ep_size, pad_multiple) of the converted artifacts compared
ARTIFACTS = [
    ("gpt_oss_tiny", 1, 256),  # MXFP4, E=8, H=I=256
    ("gpt_oss_tiny", 4, 512),  # MXFP4, E=2, H=I=512
    ("deepseek_tiny", 2, 256),  # NVFP4, E=8, H=I=256
    ("deepseek_tiny", 4, 128),  # NVFP4, E=4, H=I=256
    ("llama4_tiny", 1, 256),  # NVFP4, E=8, H=I=256
]


def assert_preparation_gives_the_rank_bytes(source, out, device: str = "cpu") -> None:
    """``prepare_trtllm_fp4_weights`` on each rank's source codes (read by moeshard's adapter,
    zero-padded here) equals the rank files, layer by layer (GPT-OSS: with its SwiGLU constants)."""
    m = Manifest.read(out)
    h_pad, i_pad = m.padding.hidden_size_padded, m.padding.intermediate_size_padded
    swiglu = None
    if m.activation["type"] == "swiglu_oai":  # GPT-OSS's activation as FlashInfer's unified API spells it
        from flashinfer.fused_moe.api import SwiGLU

        swiglu = SwiGLU(alpha=m.activation["alpha"], beta=m.activation["beta"], limit=m.activation["limit"])
    with Checkpoint(source) as ckpt:
        adapter = detect(ckpt)
        spec = adapter.spec(ckpt)
        for rank in m.ranks:
            with Checkpoint(out / rank.folder, with_config=False) as rf:
                for entry in m.moe_layers:
                    c = read_rank_experts(adapter, ckpt, spec, entry.layer, rank.experts, *rank.intermediate_slice,
                                          rank.tp_rank)
                    sf = c.sf_vec_size
                    got = prepare_trtllm_fp4_with_codes(pad_w13(c.w13, i_pad, h_pad // 2),
                                                        pad_w13(c.w13_scale, i_pad, h_pad // sf),
                                                        pad_2d(c.w2, h_pad, i_pad // 2),
                                                        pad_2d(c.w2_scale, h_pad, i_pad // sf), swiglu, device)
                    for name in LAYOUT + (("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit") if swiglu else ()):
                        want, g = rf.read(f"{entry.prefix}.{name}"), got[name].cpu()
                        assert g.dtype == want.dtype and g.shape == want.shape, name
                        same = torch.equal(g, want) if want.dtype == torch.float32 else \
                            torch.equal(g.view(torch.uint8), want.view(torch.uint8))
                        assert same, (rank.rank, entry.layer, name)


@pytest.mark.parametrize("family,ep_size,pad", ARTIFACTS)
def test_flashinfer_preparation_gives_the_rank_bytes(request, artifacts, family, ep_size, pad):
    assert_preparation_gives_the_rank_bytes(request.getfixturevalue(family), artifacts(family, ep_size, pad))


@pytest.mark.parametrize("family", ["deepseek_tiny", "llama4_tiny"])
def test_weight_view_has_the_keys_flashinfer_prepares(artifacts, family):
    """``MoeLayer.weight_view`` hands FlashInfer's unified API what ``prepare_trtllm_fp4_weights`` would."""
    layer = next(iter(moeshard.load_rank(artifacts(family, 2), 1, device="cpu").layers.values()))
    view = layer.weight_view()
    prepared = prepare_trtllm_fp4_with_codes(*(view[n].view(torch.uint8) for n in LAYOUT))
    assert set(view) == set(prepared)
    for name, t in view.items():
        assert t.dtype == prepared[name].dtype and t.shape == prepared[name].shape, name
