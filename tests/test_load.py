"""load_rank: tensors byte-equal to the rank files, kernel arguments, layout and FlashInfer checks,
and only the rank's own files read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from test_trtllm_args import launcher_checks

import moeshard
from moeshard.artifact.manifest import read_manifest
from moeshard.errors import MoeshardError

FAMILIES = ["gpt_oss_tiny", "deepseek_tiny", "llama4_tiny"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tensors_equal_the_rank_files(artifacts, family):
    out = artifacts(family, 2)
    m = read_manifest(out)
    for info in m["ranks"]:
        rw = moeshard.load_rank(out, info["rank"], device="cpu")
        assert rw.experts == info["experts"] and rw.bytes_read == sum(f["bytes"] for f in info["files"])
        assert rw.common_folder == out / "common"
        assert sorted(rw.layers) == [e["layer"] for e in m["moe_layers"]]
        n = 0
        for f in info["files"]:
            with safe_open(out / f["path"], "pt") as s:
                for name in s.keys():
                    entry = next(e for e in m["moe_layers"] if name.startswith(e["prefix"] + "."))
                    got = rw.layers[entry["layer"]].tensors[name[len(entry["prefix"]) + 1:]]
                    want = s.get_tensor(name)
                    assert got.dtype == want.dtype and got.shape == want.shape, name
                    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
                    n += 1
        assert n == sum(len(layer.tensors) for layer in rw.layers.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_kwargs_pass_the_launcher_checks(artifacts, family):
    import inspect

    from flashinfer.fused_moe import trtllm_fp4_block_scale_moe

    params = set(inspect.signature(trtllm_fp4_block_scale_moe).parameters)
    out = artifacts(family, 2)
    rw = moeshard.load_rank(out, 1, device="cpu")
    for layer in rw.layers.values():
        t = 3
        nvfp4 = "hidden_states_scale_global" in layer.tensors
        hs = (torch.zeros(t, layer.hidden_size // 2, dtype=torch.uint8) if nvfp4
              else torch.zeros(t, layer.hidden_size, dtype=torch.bfloat16))
        scale = torch.zeros(t, layer.hidden_size // 16, dtype=torch.float8_e4m3fn) if nvfp4 else None
        kw = layer.kernel_kwargs(torch.zeros(t, layer.args["num_experts"]), hs, scale)
        if nvfp4:
            from flashinfer.tllm_enums import SfLayout

            kw["hidden_states_scale_layout"] = SfLayout.layout_linear
        assert set(kw) <= params
        assert launcher_checks(kw) == []
        assert kw["local_expert_offset"] == rw.experts[0] and kw["local_num_experts"] == len(rw.experts)


def test_reads_only_its_own_files(tmp_path, artifacts):
    out = tmp_path / "a"
    shutil.copytree(artifacts("deepseek_tiny", 4), out)
    for p in list(out.iterdir()):
        if p.is_dir() and p.name != "rank-00002":
            shutil.rmtree(p)
    rw = moeshard.load_rank(out, 2, device="cpu")
    assert rw.experts == list(range(8, 12))


def test_refuses_another_layout_version_and_flashinfer(tmp_path, artifacts):
    out = tmp_path / "a"
    shutil.copytree(artifacts("gpt_oss_tiny", 2), out)
    path = out / "moeshard.json"
    m = json.loads(path.read_text())
    m["layout"]["version"] = 2
    path.write_text(json.dumps(m))
    with pytest.raises(MoeshardError, match="layout: expected trtllm-gen-fp4 version 1, found trtllm-gen-fp4 version 2"):
        moeshard.load_rank(out, 0, device="cpu")
    m["layout"]["version"] = 1
    m["tool"]["flashinfer"] = "0.5.0"
    path.write_text(json.dumps(m))
    with pytest.raises(MoeshardError, match=r"made for flashinfer-python 0\.5\.0, found 0\.7\.2\.post1 installed"):
        moeshard.load_rank(out, 0, device="cpu")
    assert moeshard.load_rank(out, 0, device="cpu", check_flashinfer=False).rank == 0
    with pytest.raises(MoeshardError, match=r"no rank 7"):
        moeshard.load_rank(out, 7, device="cpu", check_flashinfer=False)
