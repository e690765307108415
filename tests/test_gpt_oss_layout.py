"""Every rank tensor of a converted GPT-OSS artifact, byte for byte, against FlashInfer's helpers
applied per expert the way vLLM prepares GPT-OSS for trtllm-gen; decode round trips; padding."""

from __future__ import annotations

import pytest
import torch
from _reference import vllm_gpt_oss_trtllm
from safetensors import safe_open

from moeshard.artifact.manifest import read_manifest
from moeshard.checkpoints.source import Checkpoint
from moeshard.layouts.trtllm import from_trtllm

LEAVES = ("gemm1_weights", "gemm1_weights_scale", "gemm1_bias", "gemm2_weights", "gemm2_weights_scale", "gemm2_bias")


def rank_tensors(out, rank: dict, prefix: str) -> dict[str, torch.Tensor]:
    with Checkpoint(out / rank["folder"], with_config=False) as f:
        return {n[len(prefix) + 1:]: f.read(n) for n in f.tensors if n.startswith(prefix + ".")}


@pytest.mark.parametrize("ep_size,pad", [(1, 256), (2, 256), (4, 256), (8, 256), (2, 128), (4, 512)])
def test_rank_bytes_equal_vllm_flashinfer(gpt_oss_tiny, gpt_oss_artifacts, ep_size, pad):
    out = gpt_oss_artifacts(ep_size, pad)
    m = read_manifest(out)
    assert (m["padding"]["hidden_size_padded"], m["padding"]["intermediate_size_padded"]) == \
        (-(-160 // pad) * pad, -(-224 // pad) * pad)
    check_rank_bytes(gpt_oss_tiny, out)


@pytest.mark.parametrize("ep_size,pad", [(1, 256), (2, 256), (4, 128)])
def test_rank_bytes_with_hidden_and_intermediate_padded_differently(tmp_path_factory, ep_size, pad):
    """H 160 and I 416: padded to 256 and 512 (or 256 and 512 with 128), so that a mix-up of the
    two padded sizes anywhere shows."""
    from moeshard.convert.pipeline import convert
    from moeshard.fixtures import fixture

    src = fixture("gpt-oss", "tiny-uneven", tmp_path_factory.mktemp("uneven") / "src")
    out = convert(src, tmp_path_factory.mktemp("uneven-out") / "out", ep_size=ep_size, pad_multiple=pad).out
    m = read_manifest(out)
    assert (m["padding"]["hidden_size_padded"], m["padding"]["intermediate_size_padded"]) == \
        (-(-160 // pad) * pad, -(-416 // pad) * pad)
    check_rank_bytes(src, out)


def check_rank_bytes(source, out) -> None:
    """Every rank tensor of ``out`` against vLLM's per-expert preparation of ``source``'s slice."""
    m = read_manifest(out)
    h_pad, i_pad = m["padding"]["hidden_size_padded"], m["padding"]["intermediate_size_padded"]
    with Checkpoint(source) as src:
        for rank in m["ranks"]:
            e0, e1 = rank["experts"][0], rank["experts"][-1] + 1
            for layer in m["moe_layers"]:
                p = layer["prefix"]
                rd = lambda leaf: src.read(f"{p}.{leaf}", e0, e1)  # noqa: E731
                want = vllm_gpt_oss_trtllm(rd("gate_up_proj_blocks"), rd("gate_up_proj_scales"),
                                           rd("gate_up_proj_bias"), rd("down_proj_blocks"), rd("down_proj_scales"),
                                           rd("down_proj_bias"), h_pad, i_pad)
                got = rank_tensors(out, rank, p)
                for leaf in LEAVES:
                    assert got[leaf].dtype == want[leaf].dtype, leaf
                    assert got[leaf].shape == want[leaf].shape, leaf
                    assert torch.equal(got[leaf].view(torch.uint8), want[leaf].view(torch.uint8)), (rank["rank"], p, leaf)
                for leaf, v in (("gemm1_alpha", 1.702), ("gemm1_beta", 1.0), ("gemm1_clamp_limit", 7.0)):
                    assert torch.equal(got[leaf], torch.full((e1 - e0,), v, dtype=torch.float32)), leaf


@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_decode_gives_source_bytes_and_zero_padding(gpt_oss_tiny, gpt_oss_artifacts, ep_size):
    out = gpt_oss_artifacts(ep_size)
    m = read_manifest(out)
    h, i = m["padding"]["hidden_size"], m["padding"]["intermediate_size"]
    with Checkpoint(gpt_oss_tiny) as src:
        for rank in m["ranks"]:
            e0, e1 = rank["experts"][0], rank["experts"][-1] + 1
            for layer in m["moe_layers"]:
                p = layer["prefix"]
                c = from_trtllm(rank_tensors(out, rank, p))
                i_pad = c.intermediate_size
                blocks = src.read(f"{p}.gate_up_proj_blocks", e0, e1).flatten(-2)
                gate, up = c.w13[:, i_pad:], c.w13[:, :i_pad]
                # Source rows interleave gate (even) and up (odd).
                assert torch.equal(gate[:, :i, : h // 2], blocks[:, 0::2])
                assert torch.equal(up[:, :i, : h // 2], blocks[:, 1::2])
                scales = src.read(f"{p}.gate_up_proj_scales", e0, e1)
                assert torch.equal(c.w13_scale[:, i_pad:][:, :i, : h // 32], scales[:, 0::2])
                assert torch.equal(c.w13_scale[:, :i_pad][:, :i, : h // 32], scales[:, 1::2])
                bias = src.read(f"{p}.gate_up_proj_bias", e0, e1).float()
                assert torch.equal(c.w13_bias[:, i_pad:][:, :i], bias[:, 0::2])
                assert torch.equal(c.w2[:, :h, : i // 2], src.read(f"{p}.down_proj_blocks", e0, e1).flatten(-2))
                assert torch.equal(c.w2_scale[:, :h, : i // 32], src.read(f"{p}.down_proj_scales", e0, e1))
                assert torch.equal(c.w2_bias[:, :h], src.read(f"{p}.down_proj_bias", e0, e1).float())
                # Everything outside the source region is zero padding.
                for t, (rows, cols) in ((up, (i, h // 2)), (gate, (i, h // 2)), (c.w2, (h, i // 2))):
                    mask = torch.ones_like(t, dtype=torch.bool)
                    mask[:, :rows, :cols] = False
                    assert not t[mask].any()
                assert not c.w13_scale[:, :i_pad][:, i:].any() and not c.w13_scale[:, :, h // 32:].any()
                assert not c.w2_scale[:, h:].any() and not c.w2_scale[:, :, i // 32:].any()
                assert not c.w13_bias[:, i:i_pad].any() and not c.w2_bias[:, h:].any()


def test_artifact_layout_on_disk(gpt_oss_tiny, gpt_oss_artifacts):
    out = gpt_oss_artifacts(2)
    m = read_manifest(out)
    assert [r["experts"] for r in m["ranks"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r["local_expert_offset"] for r in m["ranks"]] == [0, 4]
    assert (out / "config.json").read_bytes() == (gpt_oss_tiny / "config.json").read_bytes()
    # common/ holds every non-expert tensor, unchanged.
    with Checkpoint(gpt_oss_tiny) as src, Checkpoint(out / "common", with_config=False) as common:
        expert_leaves = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
                         "down_proj_scales", "down_proj_bias")
        want = sorted(n for n in src.tensors if not n.endswith(expert_leaves))
        assert sorted(common.tensors) == want
        for n in want:
            a, b = src.read(n), common.read(n)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n
    # Rank files are plain safetensors with the FlashInfer argument names.
    with safe_open(out / m["ranks"][1]["files"][0]["path"], "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.gemm1_weights_scale" in keys
    assert len(keys) == 2 * 9
