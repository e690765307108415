"""load_rank: tensors byte-equal to the rank files, the layout checks, version 1 artifacts, and
only the rank's own files read (kernel arguments: ``test_kernel_args.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_trtllm_args import launcher_checks

import moeshard
from moeshard.artifact.manifest import Manifest, read_manifest
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


def test_reads_only_its_own_files(tmp_path, artifacts):
    out = tmp_path / "a"
    shutil.copytree(artifacts("deepseek_tiny", 4), out)
    for p in list(out.iterdir()):
        if p.is_dir() and p.name != "rank-00002":
            shutil.rmtree(p)
    rw = moeshard.load_rank(out, 2, device="cpu")
    assert rw.experts == list(range(8, 12))


def test_refuses_another_layout_version(tmp_path, artifacts):
    out = tmp_path / "a"
    shutil.copytree(artifacts("gpt_oss_tiny", 2), out)
    path = out / "moeshard.json"
    m = json.loads(path.read_text())
    m["layout"]["version"] = 2
    path.write_text(json.dumps(m))
    with pytest.raises(MoeshardError, match="layout: expected trtllm-gen-fp4 version 1, found trtllm-gen-fp4 version 2"):
        moeshard.load_rank(out, 0, device="cpu")
    m["layout"]["version"] = 1
    path.write_text(json.dumps(m))
    with pytest.raises(MoeshardError, match=r"no rank 7"):
        moeshard.load_rank(out, 7, device="cpu")


#: Version 1 manifests as moeshard wrote them (85f75bd; 3783950, the last version 1 writer, after the
#: DeepSeek fixture gained its exporter quirks), of ``moeshard fixture`` tiny converted with --ep-size 2
V1 = {"gpt_oss_tiny": "manifest-v1-85f75bd-gpt-oss-ep2.json", "deepseek_tiny": "manifest-v1-3783950-deepseek-ep2.json"}


@pytest.mark.parametrize("family", sorted(V1))
def test_reads_version_1_artifacts(tmp_path, artifacts, family):
    """Today's default conversion writes the rank bytes a version 1 artifact has (its GEMM2 has the
    padded hidden size), and such an artifact loads with kernel arguments that take it as it is."""
    from test_kernel_args import kwargs_of

    v1 = json.loads((Path(__file__).parent / "data" / V1[family]).read_text())
    out = tmp_path / "a"
    shutil.copytree(artifacts(family, 2), out)
    v2 = read_manifest(out)
    assert [f["sha256"] for r in v2["ranks"] for f in r["files"]] == \
        [f["sha256"] for r in v1["ranks"] for f in r["files"]]
    (out / "moeshard.json").write_text(json.dumps(v1))
    m = Manifest.read(out)
    assert m.schema_version == 1 and m.layout.fingerprint == {}
    assert (m.padding.hidden_padding, m.padding.gemm2_rows) == ("vllm", m.padding.hidden_size_padded)
    assert all("valid_hidden_size" not in e.kernel_args for e in m.moe_layers)  # recorded, but not for the kernel
    for rank in (0, 1):
        for layer in moeshard.load_rank(out, rank, device="cpu").layers.values():
            kw = kwargs_of(layer, "bf16" if family == "gpt_oss_tiny" else "nvfp4")
            assert kw["valid_hidden_size"] is None and launcher_checks(kw) == []
    v1["tool"]["flashinfer"] = "0.5.0"  # no fingerprint: the FlashInfer version it was made with must be installed
    (out / "moeshard.json").write_text(json.dumps(v1))
    with pytest.raises(MoeshardError, match=r"made for flashinfer-python 0\.5\.0, found 0\.7\.2\.post1 installed, "
                                            r"and it records no layout fingerprint \(schema version 1\)"):
        moeshard.load_rank(out, 0, device="cpu")
    assert moeshard.load_rank(out, 0, device="cpu", check_flashinfer=False).rank == 0
