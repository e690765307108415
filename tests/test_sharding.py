"""Tensor-parallel, EP x TP and round-robin shards: every rank's bytes against FlashInfer's helpers
applied to the same slice cut the way vLLM cuts it; validate passes on every such artifact
(the sum over all ranks equals the unsharded layer); splits the kernel cannot take are refused."""

from __future__ import annotations

import pytest
import torch
from _reference import pad_2d, pad_w13, vllm_gpt_oss_trtllm, vllm_nvfp4_trtllm
from test_nvfp4 import rank_tensors, source_experts

from moeshard.artifact.manifest import read_manifest
from moeshard.checkpoints.source import Checkpoint
from moeshard.convert.pipeline import convert
from moeshard.errors import MoeshardError
from moeshard.validate import validate

FAMILIES = ["gpt_oss_tiny", "deepseek_tiny", "llama4_tiny"]
LAYOUTS = [(1, 2, "contiguous"), (1, 4, "contiguous"), (2, 2, "contiguous"), (2, 1, "round-robin"),
           (2, 2, "round-robin")]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, request):
    made = {}

    def get(family, ep, tp, placement):
        key = (family, ep, tp, placement)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}-ep{ep}-tp{tp}-{placement}") / "out"
            convert(request.getfixturevalue(family), out, ep_size=ep, tp_size=tp, placement=placement)
            made[key] = out
        return made[key]

    return get


def vllm_gpt_oss_rank(src: Checkpoint, prefix: str, experts: list[int], tp_rank: int, tp: int, h_pad: int,
                      i_pad: int) -> dict[str, torch.Tensor]:
    """vLLM's GptOssModel._load_weights_mxfp4 cut (EP: expert rows; TP: per-rank I =
    ceil(I/32/tp)*32 on the interleaved rows, w2 columns, w2 bias on tp rank 0 only), then its
    trtllm-gen preparation."""
    rd = lambda leaf: src.read(f"{prefix}.{leaf}")[experts]  # noqa: E731
    i = src.config["intermediate_size"]
    per = -(-i // 32 // tp) * 32
    s, e = min(tp_rank * per, i), min((tp_rank + 1) * per, i)
    b2 = rd("down_proj_bias") if tp_rank == 0 else torch.zeros_like(rd("down_proj_bias"))
    return vllm_gpt_oss_trtllm(rd("gate_up_proj_blocks")[:, 2 * s:2 * e], rd("gate_up_proj_scales")[:, 2 * s:2 * e],
                               rd("gate_up_proj_bias")[:, 2 * s:2 * e], rd("down_proj_blocks")[:, :, s // 32:e // 32],
                               rd("down_proj_scales")[:, :, s // 32:e // 32], b2, h_pad, i_pad)


def vllm_nvfp4_rank(src: Checkpoint, family: str, layer: int, experts: list[int], tp_rank: int, tp: int,
                    h_pad: int, i_pad: int) -> dict[str, torch.Tensor]:
    """vLLM's FusedMoE weight loader cut (w1/w3 rows narrow(0, shard*tp_rank, shard), w2
    narrow(1, ...) on packed bytes and scale columns, shard = I/tp), reorder to [w3; w1], pad, prep."""
    parts = [source_experts(src, family, layer, x, x + 1) for x in experts]
    s = {k: torch.cat([p[k] for p in parts]) if parts[0][k].dim() else parts[0][k] for k in parts[0]}
    shard = s["w1"].shape[1] // tp
    rows = slice(tp_rank * shard, (tp_rank + 1) * shard)
    w13 = torch.cat((s["w3"][:, rows], s["w1"][:, rows]), 1)
    s13 = torch.cat((s["s3"][:, rows], s["s1"][:, rows]), 1)
    w2 = s["w2"][:, :, tp_rank * shard // 2:(tp_rank + 1) * shard // 2]
    s2 = s["s2"][:, :, tp_rank * shard // 16:(tp_rank + 1) * shard // 16]
    return vllm_nvfp4_trtllm(pad_w13(w13, i_pad, h_pad // 2), pad_w13(s13, i_pad, h_pad // 16),
                             pad_2d(w2, h_pad, i_pad // 2), pad_2d(s2, h_pad, i_pad // 16),
                             s["w1_scale_2"], s["w2_scale_2"], s["a13"], s["a2"], w3_scale_2=s["w3_scale_2"])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ep,tp,placement", LAYOUTS)
def test_rank_bytes_equal_vllm_cut(request, sharded, family, ep, tp, placement):
    out = sharded(family, ep, tp, placement)
    m = read_manifest(out)
    h_pad, i_pad = m["padding"]["hidden_size_padded"], m["padding"]["intermediate_size_padded"]
    assert (m["ep_size"], m["tp_size"], m["placement"], len(m["ranks"])) == (ep, tp, placement, ep * tp)
    e = m["num_experts"]
    with Checkpoint(request.getfixturevalue(family)) as src:
        for rank in m["ranks"]:
            assert rank["rank"] == rank["ep_rank"] * tp + rank["tp_rank"]
            want_experts = (list(range(rank["ep_rank"] * e // ep, (rank["ep_rank"] + 1) * e // ep))
                            if placement == "contiguous" else list(range(rank["ep_rank"], e, ep)))
            assert rank["experts"] == want_experts
            assert (rank["local_expert_offset"] is None) == (placement == "round-robin" and ep > 1)
            a, b = rank["intermediate_slice"]
            assert rank["intermediate_padding"] == i_pad - (b - a)
            for layer in m["moe_layers"]:
                if family == "gpt_oss_tiny":
                    want = vllm_gpt_oss_rank(src, layer["prefix"], want_experts, rank["tp_rank"], tp, h_pad, i_pad)
                else:
                    want = vllm_nvfp4_rank(src, family, layer["layer"], want_experts, rank["tp_rank"], tp, h_pad, i_pad)
                got = rank_tensors(out, rank, layer["prefix"])
                for leaf, t in want.items():
                    assert got[leaf].shape == t.shape and got[leaf].dtype == t.dtype, leaf
                    assert torch.equal(got[leaf].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), \
                        (rank["rank"], layer["prefix"], leaf)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ep,tp,placement", LAYOUTS)
def test_validate_passes_and_sums_to_the_full_layer(sharded, family, ep, tp, placement):
    report = validate(sharded(family, ep, tp, placement), tokens=8)
    assert report.passed, [r.detail for r in report.rows if not r.passed]
    assert sum(r.rank == "sum" for r in report.rows) == len({r.layer for r in report.rows})


def test_gpt_oss_tp_follows_vllm_uneven_rule(sharded):
    m = read_manifest(sharded("gpt_oss_tiny", 1, 4, "contiguous"))  # I = 224 = 7 blocks of 32
    assert [r["intermediate_slice"] for r in m["ranks"]] == [[0, 64], [64, 128], [128, 192], [192, 224]]
    assert m["padding"]["intermediate_size_padded"] == 256
    assert [r["adds_gemm2_bias"] for r in m["ranks"]] == [True, False, False, False]


def test_unsupported_splits_are_refused_with_largest_valid_tp(tmp_path, gpt_oss_tiny, deepseek_tiny):
    with pytest.raises(MoeshardError, match=r"cannot be cut into --tp-size 8 .* largest valid --tp-size: 7"):
        convert(gpt_oss_tiny, tmp_path / "a", tp_size=8)
    with pytest.raises(MoeshardError, match=r"192 cannot be cut into --tp-size 8 .* largest valid --tp-size: 6"):
        convert(deepseek_tiny, tmp_path / "b", tp_size=8)
    with pytest.raises(MoeshardError, match=r"gemm1 rows\) not a multiple of 128.*no --tp-size works with --pad-multiple 16"):
        convert(deepseek_tiny, tmp_path / "c", tp_size=2, pad_multiple=16)
    with pytest.raises(MoeshardError, match="--placement striped: expected one of contiguous, round-robin"):
        convert(deepseek_tiny, tmp_path / "d", placement="striped")
    assert not any(p.exists() for p in (tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "d"))


def test_round_robin_manifest_names_engines(sharded):
    m = read_manifest(sharded("deepseek_tiny", 2, 1, "round-robin"))
    assert "not FlashInfer's from-logits trtllm_fp4_block_scale_moe" in m["placement_engines"]
    assert m["ranks"][1]["experts"] == list(range(1, 16, 2))
