"""validate catches faults: one byte of a weight, one scale, one permutation, one kernel scalar,
two ranks' files swapped; each fails and names the rank, the layer and the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moeshard.artifact.manifest import read_manifest
from moeshard.cli import app
from moeshard.errors import MoeshardError
from moeshard.validate import validate
from moeshard.validate.backends import select_backend

FAMILIES = ["gpt_oss_tiny", "deepseek_tiny", "llama4_tiny"]


def corrupt(out, rank: int, leaf: str, fn) -> str:
    """Apply fn to tensor ``leaf`` of the first MoE layer in rank ``rank``'s files; returns the prefix."""
    m = read_manifest(out)
    prefix = m["moe_layers"][0]["prefix"]
    path = out / m["ranks"][rank]["files"][0]["path"]
    t = load_file(path)
    name = f"{prefix}.{leaf}"
    t[name] = fn(t[name].clone())
    save_file(t, path)
    return prefix


def fresh(artifacts, tmp_path, family, ep=2):
    out = tmp_path / "art"
    shutil.copytree(artifacts(family, ep), out)
    return out


def flip_weight_byte(t):
    t.view(torch.uint8)[1, 0, 0] ^= 0x11  # expert 1, stored row 0 = canonical up row 0, column 0
    return t


def bump_scale(t):
    t.view(torch.uint8)[1].view(-1)[0] += 8  # expert 1, interleaved offset 0 = gemm2 row 0, block 0
    return t


def swap_rows(t):
    t[1, [0, 1]] = t[1, [1, 0]]  # stored rows 0 and 1 (canonical up rows 0 and 2) of expert 1
    return t


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("leaf,fn", [("gemm1_weights", flip_weight_byte), ("gemm2_weights_scale", bump_scale),
                                     ("gemm1_weights", swap_rows)], ids=["weight-byte", "scale", "permutation"])
def test_corrupted_tensor_fails_and_is_named(artifacts, tmp_path, family, leaf, fn):
    out = fresh(artifacts, tmp_path, family)
    prefix = corrupt(out, 1, leaf, fn)
    report = validate(out)
    bad = [r for r in report.rows if not r.passed]
    assert not report.passed and bad
    assert bad[0].rank == 1 and bad[0].layer == read_manifest(out)["moe_layers"][0]["layer"]
    assert f"rank-00001: {prefix}" in bad[0].detail and f"{leaf} (expert " in bad[0].detail, bad[0].detail
    expert1 = read_manifest(out)["ranks"][1]["experts"][1]
    assert bad[0].worst_expert == expert1 and f"{leaf} (expert {expert1})" in bad[0].detail
    assert all(r.passed for r in report.rows if r.rank == 0)


@pytest.mark.parametrize("family,leaf", [("gpt_oss_tiny", "gemm1_alpha"), ("deepseek_tiny", "output2_scale_scalar"),
                                         ("llama4_tiny", "output1_scale_gate_scalar"),
                                         ("deepseek_tiny", "hidden_states_scale_global")])
def test_corrupted_kernel_scalar_fails(artifacts, tmp_path, family, leaf):
    out = fresh(artifacts, tmp_path, family)

    def change(t):
        if t.dim() == 0:
            return t * 1.5
        t[1] = t[1] * 1.5
        return t

    prefix = corrupt(out, 0, leaf, change)
    report = validate(out)
    bad = [r for r in report.rows if not r.passed]
    assert bad and bad[0].rank == 0 and f"rank-00000: {prefix}" in bad[0].detail and leaf in bad[0].detail, bad


@pytest.mark.parametrize("family", FAMILIES)
def test_swapped_rank_files_fail(artifacts, tmp_path, family):
    out = fresh(artifacts, tmp_path, family)
    m = read_manifest(out)
    a, b = (out / m["ranks"][r]["files"][0]["path"] for r in (0, 1))
    tmp = a.with_name("swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    report = validate(out)
    failed = {r.rank for r in report.rows if not r.passed}
    assert {0, 1} <= failed
    assert any("rank-00000" in r.detail and "gemm1_weights (expert 0)" in r.detail for r in report.rows)


def test_cli_exit_status_and_message(artifacts, tmp_path):
    out = fresh(artifacts, tmp_path, "gpt_oss_tiny")
    corrupt(out, 1, "gemm1_weights", flip_weight_byte)
    r = CliRunner().invoke(app, ["validate", str(out), "--json"])
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["passed"] is False and any("rank-00001" in row["detail"] for row in doc["rows"])
    r = CliRunner().invoke(app, ["validate", str(out)])
    assert r.exit_code == 1 and "FAIL" in r.stdout


def test_clean_artifacts_pass_with_every_expert_checked(artifacts):
    for family in FAMILIES:
        report = validate(artifacts(family, 2), tokens=8)
        assert report.passed
        assert report.backend == "decode" and "not Blackwell" in report.notes[0]


def test_backend_guard_names_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on every machine
    with pytest.raises(MoeshardError, match=r"--backend trtllm-gen: .*Blackwell \(SM100/SM103\) only; found no CUDA GPU"):
        select_backend("trtllm-gen", "cpu")
    with pytest.raises(MoeshardError, match="--device cuda: no CUDA GPU found"):
        select_backend("decode", "cuda")
    assert select_backend("decode", "cpu") == ("decode", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    with pytest.raises(MoeshardError, match=r"only; found NVIDIA H200 \(SM90\)"):
        select_backend("trtllm-gen", "cuda")
    assert select_backend("auto", "cuda")[0] == "decode"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert select_backend("auto", "cuda") == ("trtllm-gen", None)


def test_layout_check_catches_what_the_decode_shares(tmp_path, gpt_oss_tiny, deepseek_tiny, monkeypatch):
    """The gated reorder and the row shuffle applied in the wrong order: the writer and the decoder
    share the mistake, so every decode check passes; the rebuild with FlashInfer's own per-expert
    preparation does not."""
    from moeshard.convert.pipeline import convert
    from moeshard.layouts import fingerprint, trtllm

    def wrong_order(rows, epilogue_tile_m, gated):
        from flashinfer.fused_moe.core import get_reorder_rows_for_gated_act_gemm_row_indices
        from flashinfer.utils import get_shuffle_matrix_a_row_indices

        probe = torch.empty(rows, 1, dtype=torch.uint8)
        shuffle = get_shuffle_matrix_a_row_indices(probe, epilogue_tile_m=epilogue_tile_m)
        return shuffle[get_reorder_rows_for_gated_act_gemm_row_indices(probe)] if gated else shuffle

    for src in (gpt_oss_tiny, deepseek_tiny):
        assert validate(convert(src, tmp_path / f"ok-{src.parent.name}", ep_size=2).out, tokens=4).passed
    monkeypatch.setattr(trtllm, "_row_permutation", wrong_order)
    # convert's own guard compares its permutations with FlashInfer's and would refuse: switch it
    # off, as for an artifact that some other writer made with this mistake
    monkeypatch.setattr(fingerprint, "moeshard_indices", fingerprint.flashinfer_indices)
    for src in (gpt_oss_tiny, deepseek_tiny):
        out = convert(src, tmp_path / f"bad-{src.parent.name}", ep_size=2).out
        report = validate(out, tokens=4)
        ranks = [r for r in report.rows if r.rank != "sum"]
        assert all(r.rel_error <= report.tolerance for r in ranks)  # the decode alone passes
        assert not report.passed and all(not r.passed and "layout check: expert" in r.detail
                                         and "gemm1_weights" in r.detail for r in ranks), [r.detail for r in ranks]
        assert all(r.layout_checked == 2 for r in ranks)


def test_choosing_what_to_check_and_the_report(artifacts):
    out = artifacts("deepseek_tiny", 4)
    m = read_manifest(out)
    report = validate(out, layers=[m["moe_layers"][1]["layer"]], ranks=[1, 3], experts=5, tokens=4, seed=3)
    assert report.passed and report.coverage["experts"] == [5, 16] and report.coverage["ranks"] == [2, 4]
    assert report.coverage["layers"] == [1, 2]
    assert sum(r.experts_checked for r in report.rows) == sum(  # the seeded sample's experts of ranks 1 and 3
        1 for e in torch.randperm(16, generator=torch.Generator().manual_seed(3 + 2))[:5].tolist() if 4 <= e < 8
        or 12 <= e < 16)
    assert not any(r.rank == "sum" for r in report.rows)  # a sample cannot be summed to the full layer
    assert [s["layer"] for s in report.layers] == [2] and report.layers[0]["artifact_bytes"] > 0
    full = validate(out, tokens=4, full=True)
    assert full.passed and all(r.layout_checked == r.experts_checked == 4 for r in full.rows if r.rank != "sum")
    doc = full.to_json()
    assert len(doc["layers"]) == 2 and doc["layers"][0]["checks"] == 5
