"""Hub as source and destination, without network: a cache in the hub's exact on-disk layout
resolved by the real huggingface_hub code with HF_HUB_OFFLINE; allow_patterns and rank-only
shard selection on the real repos' layouts; push with the commit layer replaced."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import pytest
from test_reliability import tree_bytes

from moeshard.artifact.manifest import LOCAL_NAME, read_manifest
from moeshard.checkpoints.families import detect_config, needed_tensors
from moeshard.checkpoints.hub import ALLOW_PATTERNS, needed_files
from moeshard.convert.pipeline import convert
from moeshard.errors import MoeshardError
from moeshard.validate import validate

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(cache: Path, repo_id: str, src: Path, keep=lambda name: True) -> Path:
    """``models--org--name/{blobs,refs/main,snapshots/<commit>}`` as huggingface_hub writes it:
    LFS blobs named by sha256, other files by their git blob sha1, snapshot entries symlinks."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        if not keep(p.name):
            continue
        data = p.read_bytes()
        blob = (hashlib.sha256(data).hexdigest() if p.suffix == ".safetensors"
                else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.relpath(repo / "blobs" / blob, snap), snap / p.name)
    return repo


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_repo_id_resolves_from_the_cache_offline(tmp_path, gpt_oss_tiny, offline):
    hub_cache(tmp_path / "hub", "openai/gpt-oss-tiny", gpt_oss_tiny)
    res = convert("openai/gpt-oss-tiny", tmp_path / "out", ep_size=2, cache_dir=tmp_path / "hub")
    src = read_manifest(tmp_path / "out")["source"]
    assert (src["repo_id"], src["commit"]) == ("openai/gpt-oss-tiny", COMMIT)
    for name in ("model-00000-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert src["files"][name]["sha256"] == hashlib.sha256((gpt_oss_tiny / name).read_bytes()).hexdigest()
    assert len(src["files"]["config.json"]["git_sha1"]) == 40
    local = tmp_path / "local"
    convert(gpt_oss_tiny, local, ep_size=2)
    a, b = tree_bytes(tmp_path / "out"), tree_bytes(local)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a if k not in ("moeshard.json", LOCAL_NAME))
    assert res.bytes_written > 0


def test_offline_without_the_repo_is_one_clear_error(tmp_path, offline):
    with pytest.raises(MoeshardError, match=r"org/missing: no folder org/missing here, and not in the local Hub cache .*HF_HUB_OFFLINE"):
        convert("org/missing", tmp_path / "out", cache_dir=tmp_path / "hub")


def test_gated_repo_says_how_to_authenticate(tmp_path, monkeypatch):
    import httpx2
    from huggingface_hub.errors import GatedRepoError

    def gated(*a, **k):
        raise GatedRepoError("403 gated", response=httpx2.Response(403, request=httpx2.Request("GET", "https://x")))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    with pytest.raises(MoeshardError, match=r"gated repository: accept its license .*hf auth login.*HF_TOKEN"):
        convert("nvidia/Llama-4-Scout-17B-16E-Instruct-FP4", tmp_path / "out")


def test_allow_patterns_on_the_real_repo_listing():
    from huggingface_hub.utils import filter_repo_objects

    # openai/gpt-oss-120b at the top level and in original/ and metal/ (its real file listing)
    listing = ([".gitattributes", "LICENSE", "README.md", "USAGE_POLICY", "chat_template.jinja", "config.json",
                "generation_config.json", "model.safetensors.index.json", "special_tokens_map.json",
                "tokenizer.json", "tokenizer_config.json", "metal/model.bin", "original/config.json",
                "original/dtypes.json", "original/model--00001-of-00007.safetensors"]
               + [f"model-{i:05d}-of-00014.safetensors" for i in range(15)])
    got = set(filter_repo_objects(listing, allow_patterns=list(ALLOW_PATTERNS)))
    assert not any(p.startswith(("original/", "metal/")) for p in got)
    assert {f"model-{i:05d}-of-00014.safetensors" for i in range(15)} <= got
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
            "chat_template.jinja"} <= got and "README.md" not in got


def _deepseek_index(layers=range(3, 5), experts=256, per_shard=40) -> tuple[dict, dict]:
    """nvidia/DeepSeek-R1-FP4's layout: per-expert tensors in key order over one-based 6-digit shards."""
    names = []
    for layer in layers:
        p = f"model.layers.{layer}.mlp"
        names += [f"model.layers.{layer}.self_attn.o_proj.weight", f"{p}.gate.weight", f"{p}.gate.e_score_correction_bias"]
        names += [f"{p}.experts.{x}.{proj}.{leaf}" for x in range(experts) for proj in ("down_proj", "gate_proj", "up_proj")
                  for leaf in ("input_scale", "weight", "weight_scale", "weight_scale_2")]
    names.append("model.embed_tokens.weight")
    n = -(-len(names) // (per_shard * 12))
    wm = {name: f"model-{i // (per_shard * 12) + 1:05d}-of-{n:06d}.safetensors" for i, name in enumerate(names)}
    cfg = {"model_type": "deepseek_v3", "n_routed_experts": experts, "num_hidden_layers": 5, "first_k_dense_replace": 3}
    return wm, cfg


def test_rank_only_selection_on_deepseek_layout():
    wm, cfg = _deepseek_index()
    adapter = detect_config(cfg, {"quantization": {"quant_algo": "NVFP4"}}, "config.json")
    experts = set(range(96, 128))  # EP 8, rank 3
    names = needed_tensors(adapter, cfg, wm, experts, common=False)
    assert all(".experts." not in n or int(n.split(".experts.")[1].split(".")[0]) in experts
               or n.endswith("input_scale") for n in names)
    assert "model.layers.3.mlp.gate.weight" in names and "model.embed_tokens.weight" not in names
    assert "model.layers.4.mlp.experts.200.up_proj.input_scale" in names  # a13 is a maximum over all experts
    own = needed_files(wm, {n for n in names if not n.endswith("input_scale")})
    everything = needed_files(wm, set(wm))
    assert len(own) <= len(everything) // 2  # its weights: 2 of 8 layers-worth of shards, plus boundaries
    assert set(needed_files(wm, names)) <= set(everything)
    with_common = needed_tensors(adapter, cfg, wm, experts, common=True)
    assert "model.embed_tokens.weight" in with_common and "model.layers.3.self_attn.o_proj.weight" in with_common


@pytest.mark.parametrize("family,ep,rank", [("deepseek_tiny", 4, 3), ("gpt_oss_tiny", 2, 1)])
def test_rank_only_run_downloads_only_what_it_needs(request, tmp_path, offline, family, ep, rank):
    src = request.getfixturevalue(family)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    cfg = json.loads((src / "config.json").read_text())
    qcfg = json.loads((src / "hf_quant_config.json").read_text()) if (src / "hf_quant_config.json").exists() else None
    adapter = detect_config(cfg, qcfg, "config.json")
    e = adapter.num_experts(cfg)
    needed = set(needed_files(index, needed_tensors(adapter, cfg, index, set(range(rank * e // ep, (rank + 1) * e // ep)),
                                                    False)))
    # The cache holds the metadata and only the needed shards: anything else would fail the run.
    hub_cache(tmp_path / "hub", "org/model", src, keep=lambda n: not n.endswith(".safetensors") or n in needed)
    out = tmp_path / "out"
    convert("org/model", out, ep_size=ep, ranks=[rank], common=False, cache_dir=tmp_path / "hub")
    m = read_manifest(out)
    assert [r["rank"] for r in m["ranks"]] == [rank] and m["rank_count"] == ep and m["common"] is None
    full = tmp_path / "full"
    convert(src, full, ep_size=ep)
    own = f"rank-{rank:05d}"
    assert tree_bytes(out / own) == tree_bytes(full / own)
    assert sorted(p.name for p in out.iterdir()) == sorted(["moeshard.json", LOCAL_NAME, "config.json", own]
                                                             + [n for n in ("generation_config.json", "hf_quant_config.json")
                                                                if (src / n).exists()])
    assert validate(out).passed


def test_push_makes_one_commit_with_every_file_and_a_model_card(tmp_path, artifacts, monkeypatch):
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import CommitInfo

    out = tmp_path / "art"
    shutil.copytree(artifacts("deepseek_tiny", 2), out)
    (out / ".moeshard.lock").write_text("")
    made = {}

    def create_repo(self, repo_id, **kw):
        made["repo"] = (repo_id, kw)

    def create_commit(self, repo_id, operations, commit_message, **kw):
        made["commit"] = (repo_id, sorted(op.path_in_repo for op in operations), commit_message, kw)
        made["card"] = next(op.path_or_fileobj for op in operations if op.path_in_repo == "README.md")
        return CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/abc", commit_message=commit_message,
                          commit_description="", oid="abc", pr_url=None)

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    monkeypatch.setattr("huggingface_hub.hf_api.is_xet_available", lambda: False)
    from moeshard.artifact.manifest import Manifest
    from moeshard.artifact.push import push

    info = push(out, "me/ds-tiny-ep2")
    repo_id, paths, message, kw = made["commit"]
    assert repo_id == "me/ds-tiny-ep2" and info.oid == "abc"
    assert paths == sorted([f.path for f in Manifest.read(out).files()] + ["moeshard.json", "README.md"])
    assert message == "moeshard deepseek artifact: 2 ranks (ep 2 x tp 1)"
    card = made["card"].decode()
    assert not (out / "README.md").exists()  # made in memory, never written into the artifact
    assert "moeshard.load_rank" in card and "| 1 | 1 | 0 | 8..15 (8) | 0..192 |" in card and "nvfp4" in card
    from huggingface_hub import ModelCard

    assert ModelCard(card).data.tags == ["moeshard", "flashinfer", "trtllm-gen", "nvfp4"]  # the front matter parses
    assert made["repo"] == ("me/ds-tiny-ep2", {"private": None, "exist_ok": True, "repo_type": "model"})


def test_inspect_a_repo_id_from_the_cache(tmp_path, llama4_tiny, offline, monkeypatch):
    from moeshard.inspect import inspect_path

    hub_cache(tmp_path / "hub", "nvidia/scout-tiny", llama4_tiny)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    info = inspect_path("nvidia/scout-tiny")
    assert info["family"] == "llama4" and info["num_experts"] == 8
