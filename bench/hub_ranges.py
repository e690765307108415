"""Bytes and time per rank of a Hub run by HTTP range, against downloading whole shards.

Serves real-size fixtures through the local Hub of the tests (``tests/hubserver.py``, in a child
process so that it does not share the client's interpreter) and, per rank, runs
``python -m moeshard convert org/NAME --ranks K --no-common --json`` with a fresh cache
(``HF_ENDPOINT`` pointing at the local Hub). The baseline is what a rank-only run did before:
``snapshot_download`` of the configs and of every shard holding a tensor the rank reads (by the
index); its bytes are exact for every rank, its time is measured for the first rank of each
checkpoint and scaled by bytes for the others (``~``).

    moeshard fixture deepseek-r1-fp4 --preset deepseek-r1 --layers 3 -o /work/bench-hub/deepseek-r1
    moeshard fixture gpt-oss --preset gpt-oss-120b --layers 2 -o /work/bench-hub/gpt-oss-120b
    python bench/hub_ranges.py /work/bench-hub/deepseek-r1 /work/bench-hub/gpt-oss-120b \\
        --work /work/bench-hub/run --json-out bench-hub-ranges.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _common import report

ROOT = Path(__file__).resolve().parents[1]
SERVE = r'''
import sys, time
sys.path.insert(0, sys.argv[1])
from hubserver import HubServer
with HubServer() as hub:
    for spec in sys.argv[2:]:
        repo, folder = spec.split("=", 1)
        hub.add_repo(repo, folder)
    print(hub.url, flush=True)
    while True:
        time.sleep(3600)
'''
WHOLE = r'''
import json, sys
from huggingface_hub import snapshot_download
from moeshard.checkpoints.hub import META_PATTERNS
snapshot_download(sys.argv[1], allow_patterns=list(META_PATTERNS) + json.loads(sys.argv[2]), cache_dir=sys.argv[3])
'''


def whole_shards(folder: Path, ep: int, tp: int, rank: int) -> list[str]:
    """The shards a rank-only run downloaded whole before ranged reads (by the index)."""
    from moeshard.checkpoints.families import detect_config, needed_tensors
    from moeshard.checkpoints.hub import needed_files
    from moeshard.convert.plan import rank_experts
    from moeshard.files import load_json

    cfg = load_json(folder / "config.json")
    qc = load_json(folder / "hf_quant_config.json") if (folder / "hf_quant_config.json").is_file() else None
    wm = load_json(folder / "model.safetensors.index.json")["weight_map"]
    adapter = detect_config(cfg, qc, folder)
    experts = set(rank_experts(adapter.num_experts(cfg), ep, tp, "contiguous", rank))
    return needed_files(wm, needed_tensors(adapter, cfg, wm, experts, False))


def run(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return r, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="+", type=Path, help="checkpoint folders (moeshard fixture ...)")
    ap.add_argument("--work", type=Path, required=True, help="scratch folder (caches and outputs, removed per rank)")
    ap.add_argument("--sharding", default="8x1,4x2", help="EPxTP sizes, comma-separated (default 8x1,4x2)")
    ap.add_argument("--ranks", default="0,3,7", help="ranks to run of each sharding (default 0,3,7)")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    repos = {f"bench/{p.name}": p.resolve() for p in a.sources}
    server = subprocess.Popen([sys.executable, "-c", SERVE, str(ROOT / "tests"),
                               *(f"{r}={p}" for r, p in repos.items())], stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        env = dict(os.environ, PYTHONPATH=str(ROOT), HF_ENDPOINT=url, HF_TOKEN="hf_bench",
                   HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        rows = []
        for repo, folder in repos.items():
            whole_rate = None
            for sharding in a.sharding.split(","):
                ep, tp = map(int, sharding.split("x"))
                for rank in map(int, a.ranks.split(",")):
                    cache, out = a.work / "cache", a.work / "out"
                    shutil.rmtree(cache, ignore_errors=True), shutil.rmtree(out, ignore_errors=True)
                    r, wall = run([sys.executable, "-m", "moeshard", "convert", repo, "-o", str(out), "--ep-size",
                                   str(ep), "--tp-size", str(tp), "--ranks", str(rank), "--no-common", "--json"],
                                  {**env, "HF_HUB_CACHE": str(cache)})
                    t = json.loads(r.stdout)["transfer"]
                    shards = whole_shards(folder, ep, tp, rank)
                    whole = sum((folder / s).stat().st_size for s in shards)
                    whole_s = None
                    if whole_rate is None:  # the baseline's time, measured once per checkpoint
                        shutil.rmtree(cache, ignore_errors=True)
                        _, whole_s = run([sys.executable, "-c", WHOLE, repo, json.dumps(shards), str(cache)],
                                         {**env, "HF_HUB_CACHE": str(cache)})
                        whole_rate = whole / whole_s
                    shutil.rmtree(cache, ignore_errors=True), shutil.rmtree(out, ignore_errors=True)
                    own = t["share"] / tp  # the rank's own bytes: its experts, its TP slice of them
                    rows.append({
                        "checkpoint": folder.name, "ep x tp": sharding, "rank": rank,
                        "rank's bytes GB": round(own / 1e9, 3),
                        "fetched GB": round(t["fetched"] / 1e9, 3),
                        "fetched / rank's bytes": round(t["fetched"] / own, 3),
                        "of which shared + headers MB": round((t["shared"] + t["headers"]) / 1e6, 1),
                        "requests": t["requests"], "fetch s": t["seconds"], "fetch MB/s": t["rate_mb_s"],
                        "convert run s": round(wall, 1),
                        "whole shards GB": round(whole / 1e9, 3),
                        "whole-shard download s": (round(whole_s, 1) if whole_s is not None else
                                                   f"~{whole / whole_rate:.1f}"),
                    })
                    print(rows[-1], file=sys.stderr, flush=True)
        report(rows, a.json_out, "Hub run of one rank by HTTP range vs whole shards (local Hub on 127.0.0.1)")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
