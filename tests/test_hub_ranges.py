"""Rank-only Hub runs read by HTTP range, against a local Hub (tests/hubserver.py) that the real
huggingface_hub client talks to: the bytes each rank asks for against its share, artifacts equal
to a whole-download conversion, the cache (nothing fetched twice), faults, and the manifest's
record of what was verified."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import pytest
from hubserver import HubServer, patch_endpoint
from test_reliability import run_cli, tree_bytes

from moeshard.artifact.manifest import MANIFEST_NAME, Manifest, read_manifest
from moeshard.artifact.verify import check_source, verify
from moeshard.checkpoints import ranged
from moeshard.checkpoints.families import detect
from moeshard.checkpoints.ranged import CACHE_DIR, RangeCache
from moeshard.checkpoints.source import Checkpoint
from moeshard.convert.pipeline import convert
from moeshard.convert.plan import rank_experts
from moeshard.errors import MoeshardError
from moeshard.validate import validate

FIXTURES = {"gpt-oss": "gpt_oss_tiny", "deepseek": "deepseek_tiny", "llama4": "llama4_tiny"}


@pytest.fixture(scope="module")
def hub(request, tmp_path_factory):
    with HubServer(lfs_redirect=True) as h:
        for repo, fixture in FIXTURES.items():
            h.add_repo(f"org/{repo}", request.getfixturevalue(fixture))
        yield h


@pytest.fixture
def hf(hub, monkeypatch):
    """huggingface_hub pointed at the local Hub, a test token, retries without long waits."""
    patch_endpoint(hub.url, monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(ranged, "RETRY_WAIT", 0.01)
    hub.clear()
    return hub


@pytest.fixture(scope="module")
def whole(request, tmp_path_factory):
    """Whole-download conversions (from the local folder: the same bytes), by (family, ep, tp)."""
    made = {}

    def get(family: str, ep: int, tp: int = 1) -> Path:
        if (family, ep, tp) not in made:
            out = tmp_path_factory.mktemp(f"whole-{family}-{ep}x{tp}") / "out"
            convert(request.getfixturevalue(FIXTURES[family]), out, ep_size=ep, tp_size=tp)
            made[family, ep, tp] = out
        return made[family, ep, tp]

    return get


def shard_bytes(hub) -> int:
    """Body bytes of the shards sent (the CDN behind the resolve redirects serves them all)."""
    return sum(r.sent for r in hub.requests() if r.method == "GET" and r.path.startswith("/cdn/"))


def budget(src: Path, ep: int, tp: int, rank: int) -> tuple[int, int]:
    """``(share, allowance)`` of a rank, from the headers, independently of moeshard's planning:
    the bytes of its experts (per-expert tensors of its experts, their rows of fused ones), and
    what every rank may read besides: the headers, the routers, every expert's activation scales
    and the per-layer scalars."""
    with Checkpoint(src) as ckpt:
        spec = detect(ckpt).spec(ckpt)
        e = spec.num_experts
        mine = set(rank_experts(e, ep, tp, "contiguous", rank))
        share = allowance = 0
        for name in spec.expert_tensors:
            t = ckpt.tensors[name]
            m = re.search(r"\.experts\.(\d+)\.", name)
            if name.endswith("input_scale"):
                allowance += t.nbytes
            elif m:
                share += t.nbytes if int(m.group(1)) in mine else 0
            elif t.shape and t.shape[0] == e:
                share += t.nbytes * len(mine) // e
            else:
                allowance += t.nbytes
        allowance += sum(ckpt.tensors[r.format(layer=x)].nbytes for x in spec.moe_layers for r in spec.router.values())
        for f in ckpt.files:
            with open(src / f, "rb") as fh:
                allowance += 8 + struct.unpack("<Q", fh.read(8))[0]
    return share, allowance


@pytest.mark.parametrize("family", FIXTURES)
@pytest.mark.parametrize("ep,tp", [(8, 1), (4, 2)])
def test_each_rank_fetches_its_share_and_writes_the_whole_download_bytes(request, tmp_path, hf, whole, family,
                                                                          ep, tp):
    src = request.getfixturevalue(FIXTURES[family])
    ranks = range(ep * tp) if tp == 1 else (0, ep * tp - 1)
    for rank in ranks:
        hf.clear()
        ticks, totals = [], []
        progress = lambda n, what: ticks.append((n, what))  # noqa: E731
        progress.total = totals.append
        out = tmp_path / f"out{rank}"
        res = convert(f"org/{family}", out, ep_size=ep, tp_size=tp, ranks=[rank], common=False,
                      cache_dir=tmp_path / f"cache{rank}", progress=progress)
        share, allowance = budget(src, ep, tp, rank)
        got = shard_bytes(hf)
        assert share <= got <= 1.1 * share + allowance, (rank, got, share, allowance)
        t = res.transfer
        assert t.fetched == got and t.share == share and t.whole > 3 * got
        assert totals[0] == sum(n for n, what in ticks if what.startswith("download"))  # the fetch, then the write
        folder = f"rank-{rank:05d}"
        assert tree_bytes(out / folder) == tree_bytes(whole(family, ep, tp) / folder)
        assert all(r.authorization == "Bearer hf_test_token" for r in hf.requests() if "/resolve/" in r.path)
        assert not any(r.authorization for r in hf.requests() if r.path.startswith("/cdn/"))  # another origin


def test_index_without_the_nvfp4_scales_plans_from_the_headers(tmp_path, hf, deepseek_tiny, whole):
    """The DeepSeek fixture's index is written as ModelOpt's script writes it: the FP8 source's
    weight_map, without the NVFP4 scale tensors (checkpoints.md section G)."""
    index = json.loads((deepseek_tiny / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(k.endswith(("weight_scale", "weight_scale_2", "input_scale")) for k in index)
    out = tmp_path / "out"
    convert("org/deepseek", out, ep_size=8, ranks=[5], common=False, cache_dir=tmp_path / "hub")
    assert tree_bytes(out / "rank-00005") == tree_bytes(whole("deepseek", 8) / "rank-00005")
    share, allowance = budget(deepseek_tiny, 8, 1, 5)
    assert shard_bytes(hf) <= 1.1 * share + allowance


def test_a_rerun_fetches_nothing_and_works_offline(tmp_path, hf, monkeypatch):
    import huggingface_hub.constants

    convert("org/deepseek", tmp_path / "a", ep_size=8, ranks=[2], cache_dir=tmp_path / "hub")
    assert shard_bytes(hf) > 0
    hf.clear()
    res = convert("org/deepseek", tmp_path / "b", ep_size=8, ranks=[2], cache_dir=tmp_path / "hub")
    assert shard_bytes(hf) == 0 and res.transfer.fetched == 0 and res.transfer.requests == 0
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    convert("org/deepseek", tmp_path / "c", ep_size=8, ranks=[2], cache_dir=tmp_path / "hub")
    assert tree_bytes(tmp_path / "c") == tree_bytes(tmp_path / "b")
    assert validate(tmp_path / "c").passed  # the reference reads the same cache


def test_bytes_that_were_not_fetched_are_never_read(tmp_path, hf):
    convert("org/gpt-oss", tmp_path / "out", ep_size=8, ranks=[0], common=False, cache_dir=tmp_path / "hub")
    root = next((tmp_path / "hub").glob(f"models--org--gpt-oss/{CACHE_DIR}/*"))
    with Checkpoint(root) as ckpt:
        name = "model.layers.1.mlp.experts.down_proj_blocks"
        assert ckpt.read(name, 0, 1).any()  # rank 0's expert
        with pytest.raises(MoeshardError, match=r"down_proj_blocks: bytes \d+-\d+ were not fetched"):
            ckpt.read(name, 1, 2)


def _tensor_at(hub, repo: str, src: Path, name: str):
    """A fault matcher: a ranged GET of the CDN object of ``name``'s shard covering its first byte."""
    with Checkpoint(src) as ckpt:
        t = ckpt.tensors[name]
    sha = hub.repos[repo].files[t.file].sha256

    def match(method, path, rng):
        if method != "GET" or sha not in path or not rng:
            return False
        a, _, b = rng.partition("=")[2].partition("-")
        return int(a) <= t.offset <= int(b)

    return match


NAME = "model.layers.2.mlp.experts.7.up_proj.weight"  # rank 3 of EP 8 on deepseek tiny


@pytest.mark.parametrize("kind,kw", [("drop", {}), ("short", {}), ("truncate", {}), ("status", {"status": 503}),
                                     ("status", {"status": 500, "times": 3})])
def test_a_fault_mid_range_is_retried(tmp_path, hf, deepseek_tiny, whole, kind, kw):
    fault = hf.add_fault(kind, match=_tensor_at(hf, "org/deepseek", deepseek_tiny, NAME), **kw)
    convert("org/deepseek", tmp_path / "out", ep_size=8, ranks=[3], common=False, cache_dir=tmp_path / "hub")
    assert fault.fired == kw.get("times", 1)
    assert tree_bytes(tmp_path / "out" / "rank-00003") == tree_bytes(whole("deepseek", 8) / "rank-00003")
    if kind == "truncate":  # a valid but short 206: the rest is asked for from where it stopped
        first = next(r for r in hf.requests() if r.fault == "truncate")
        a, b = first.span()
        assert any(r.span() == (a + first.sent, b) for r in hf.requests())


def test_a_failed_fetch_is_one_line_and_resume_fetches_only_the_rest(tmp_path, hf, deepseek_tiny, whole):
    hf.add_fault("status", status=500, times=10**6, match=_tensor_at(hf, "org/deepseek", deepseek_tiny, NAME))
    out = tmp_path / "out"
    with pytest.raises(MoeshardError) as e:
        convert("org/deepseek", out, ep_size=8, ranks=[3], common=False, cache_dir=tmp_path / "hub")
    assert "\n" not in str(e.value) and re.match(r"org/deepseek: the Hub request failed \(.*500", str(e.value))
    assert not (out / MANIFEST_NAME).exists() and not list(out.glob("rank-*"))  # nothing written
    cache = RangeCache.at(next((tmp_path / "hub").glob(f"models--org--deepseek/{CACHE_DIR}/*")))
    for f, spans in cache.spans.items():  # the journal lists only bytes that arrived whole
        data, orig = (cache.root / f).read_bytes(), (deepseek_tiny / f).read_bytes()
        assert all(data[a:b] == orig[a:b] for a, b in spans)
    first = [(r.path, *r.span()) for r in hf.requests() if r.path.startswith("/cdn/") and r.status == 206]
    hf.clear()
    convert("org/deepseek", out, ep_size=8, ranks=[3], common=False, cache_dir=tmp_path / "hub", resume=True)
    again = [(r.path, *r.span()) for r in hf.requests() if r.path.startswith("/cdn/")]
    assert again and not any(f == g and a < d and c < b for f, a, b in first for g, c, d in again)  # none twice
    assert tree_bytes(out / "rank-00003") == tree_bytes(whole("deepseek", 8) / "rank-00003")


def test_manifest_records_what_was_read_and_verify_compares_it(tmp_path, hf, llama4_tiny):
    out = tmp_path / "out"
    convert("org/llama4", out, ep_size=8, ranks=[6], common=False, cache_dir=tmp_path / "hub")
    src = Manifest.read(out).source
    assert src.ranged
    shard = "model-00004-of-00004.safetensors"
    rec = src.files[shard]
    data = (llama4_tiny / shard).read_bytes()
    n = 8 + struct.unpack("<Q", data[:8])[0]
    assert rec["header_sha256"] == hashlib.sha256(data[:n]).hexdigest()
    assert rec["sha256"] == hashlib.sha256(data).hexdigest()  # the Hub's, of the whole file
    with Checkpoint(llama4_tiny) as ckpt:
        t = ckpt.tensors["language_model.model.layers.1.feed_forward.experts.down_proj"]
        row = t.nbytes // 8
        got = rec["tensors"]["language_model.model.layers.1.feed_forward.experts.down_proj[6:7]"]
        assert got == {"bytes": row, "sha256": hashlib.sha256(data[t.offset + 6 * row:t.offset + 7 * row]).hexdigest()}
    assert all(c.ok for c in verify(out))
    check = check_source(out)  # against the ranged cache this machine read
    assert check.checked == sum(1 + len(r["tensors"]) for r in src.files.values() if "header_sha256" in r)
    assert not check.problems and not check.absent and "read by HTTP range" in check.summary
    whole_copy = check_source(out, llama4_tiny)
    assert whole_copy.checked == check.checked and not whole_copy.problems
    cache_file = Path(check.copy) / shard
    b = bytearray(cache_file.read_bytes())
    b[t.offset + 6 * row] ^= 0xFF
    cache_file.write_bytes(bytes(b))
    problems = check_source(out).problems
    assert len(problems) == 1 and problems[0].startswith(
        f"{shard}: language_model.model.layers.1.feed_forward.experts.down_proj[6:7]: sha256 ")


def test_a_manifest_without_the_newer_fields_still_reads(artifacts):
    doc = read_manifest(artifacts("gpt_oss_tiny", 2))
    del doc["source"]["ranged"]
    assert Manifest.from_json(doc).source.ranged is False
    del doc["source"]["files"]
    with pytest.raises(MoeshardError, match=r"Source.files is missing"):
        Manifest.from_json(doc)


def _hub_env(hub, cache: Path) -> dict:
    """The environment of a moeshard process using the local Hub (HF_ENDPOINT is read at import)."""
    return {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_TOKEN": "hf_test_token",
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def test_cli_reports_the_transfer_and_a_failure_in_one_line(tmp_path, hf):
    r = run_cli("convert", "org/gpt-oss", "-o", tmp_path / "a", "--ep-size", "8", "--ranks", "1", "--no-common",
                "--json", env=_hub_env(hf, tmp_path / "hub"))
    assert r.returncode == 0, r.stderr[-2000:]
    t = json.loads(r.stdout)["transfer"]
    assert t["fetched"] == shard_bytes(hf) and 0 < t["fetched"] < t["saved"] == t["whole"] - t["fetched"]
    r = run_cli("convert", "org/gpt-oss", "-o", tmp_path / "b", "--ep-size", "8", "--ranks", "1", "--no-common",
                "--max-workers", "2", env=_hub_env(hf, tmp_path / "hub"))
    assert r.returncode == 0 and re.search(r"fetched 0 B by HTTP range from org/gpt-oss .* saved \d", r.stderr)
    hf.add_fault("status", status=404, times=10**6, path="/cdn/")
    r = run_cli("convert", "org/gpt-oss", "-o", tmp_path / "c", "--ep-size", "8", "--ranks", "1",
                env=_hub_env(hf, tmp_path / "hub2"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("moeshard: error: org/gpt-oss: the Hub request failed (") and "404" in r.stderr
    assert not (tmp_path / "c").exists()


def test_torchrun_processes_fetch_only_their_files_and_nothing_twice(tmp_path, hf, deepseek_tiny):
    from test_torchrun import torchrun

    single = tmp_path / "single"
    convert(deepseek_tiny, single, ep_size=4, max_shard_bytes=60_000)
    r = torchrun(2, "org/deepseek", "-o", tmp_path / "multi", "--ep-size", "4", "--max-shard-size", "60KB", "-q",
                 env=_hub_env(hf, tmp_path / "hub"))
    assert r.returncode == 0, r.stderr[-3000:]
    multi = tree_bytes(tmp_path / "multi")
    assert multi.pop(MANIFEST_NAME) != (single_doc := tree_bytes(single)).pop(MANIFEST_NAME)  # source differs
    multi.pop(".moeshard-local.json"), single_doc.pop(".moeshard-local.json")
    assert multi == single_doc
    got = [(r.path, *r.span()) for r in hf.requests() if r.path.startswith("/cdn/")]
    assert not any(f == g and a < d and c < b for i, (f, a, b) in enumerate(got) for g, c, d in got[i + 1:])
    assert Manifest.read(tmp_path / "multi").source.ranged


def test_coalesce_reads_through_small_gaps_within_the_budget_and_never_cached_bytes():
    from moeshard.checkpoints.ranged import Spans, coalesce

    ranges = {"a": [(0, 4), (8, 12), (1000, 2000), (3000, 4000), (100_000, 101_000)]}
    assert coalesce(ranges, 0) == {"a": [(0, 12), (1000, 2000), (3000, 4000), (100_000, 101_000)]}
    assert coalesce(ranges, 1000) == {"a": [(0, 2000), (3000, 4000), (100_000, 101_000)]}  # smallest gap first
    assert coalesce(ranges, 2000) == {"a": [(0, 4000), (100_000, 101_000)]}
    cached = Spans()
    cached.add(2500, 2600)
    assert coalesce(ranges, 10**6, {"a": cached}) == {"a": [(0, 2000), (3000, 101_000)]}


def test_a_process_reads_only_the_experts_and_layers_of_its_files(deepseek_tiny):
    from moeshard.convert.distributed import Group
    from moeshard.convert.pipeline import my_jobs, source_parts
    from moeshard.convert.plan import Options, make_plan

    with Checkpoint(deepseek_tiny) as ckpt:
        adapter = detect(ckpt)
        plan = make_plan(ckpt, adapter.spec(ckpt), Options(ep_size=4, max_shard_bytes=60_000, common=False))
        assert all(len(r.files) > 1 for r in plan.ranks)  # a file per layer: processes share a rank's layers
        for process in range(3):
            jobs = my_jobs(plan, Group(process, 3))
            allowed = {(x, e) for r, f in jobs for x in f.layers for e in r.experts}
            got = {(int(m.group(1)), int(m.group(2))) for p in source_parts(plan, ckpt, adapter, jobs) if p.own
                   if (m := re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.", p.name))}
            assert got == allowed
