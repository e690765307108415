"""On a CUDA GPU: time-to-ready of one rank (EP 8, rank 3) of real-size gpt-oss-120b layers.

(a) ``moeshard.load_rank`` from the converted artifact;
(b) what engines do today: read that rank's experts from the source shards and prepare them on
    the GPU with FlashInfer's per-expert helpers and index cache (vLLM's GPT-OSS path);
(c) the machine's limit for (a)'s bytes: reading them from disk into pinned memory, and copying
    pinned memory to the GPU, each timed alone; with perfect overlap the limit is the larger.
Cold runs drop the page cache first when the kernel allows it (the table says whether it did).

    python bench/load_gpu.py --work /tmp/load-bench --layers 4 --json-out load.json
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import torch
from _common import report
from transform_gpu import LEAVES

import moeshard
from moeshard.artifact.manifest import read_manifest
from moeshard.checkpoints.source import Checkpoint
from moeshard.convert.pipeline import convert
from moeshard.fixtures import fixture
from moeshard.validate.engines import engine_interleave, vllm_gpt_oss_trtllm

RANK, EP = 3, 8


def drop_caches() -> bool:
    subprocess.run(["sync"])
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def engines_today(src: Path, experts: list[int], cache: dict) -> tuple[float, int]:
    """Read the rank's experts from the source shards, prepare them on the GPU, per expert."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with Checkpoint(src) as ck:
        e0, e1 = experts[0], experts[-1] + 1
        for layer in range(ck.config["num_hidden_layers"]):
            p = f"model.layers.{layer}.mlp.experts"
            raw = [ck.read(f"{p}.{leaf}", e0, e1).cuda() for leaf in LEAVES]
            vllm_gpt_oss_trtllm(*raw, 3072, 3072, interleave=engine_interleave, cache=cache)
        nbytes = ck.bytes_read
    torch.cuda.synchronize()
    return time.perf_counter() - t0, nbytes


def limit(files: list[Path], chunk: int = 64 << 20) -> tuple[float, float]:
    """Seconds to read the files into pinned memory, and to copy that much pinned memory to the GPU."""
    total = sum(f.stat().st_size for f in files)
    pinned = torch.empty(chunk, dtype=torch.uint8).pin_memory()
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(memoryview(pinned.numpy())):
                pass
    t_read = time.perf_counter() - t0
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for off in range(0, total, chunk):
        m = min(chunk, total - off)
        dev[off:off + m].copy_(pinned[:m], non_blocking=True)
    torch.cuda.synchronize()
    return t_read, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/moeshard-load-bench"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--readers", type=int, default=None, help="reader threads of load_rank (default: its own)")
    a = ap.parse_args()
    if a.readers:
        from moeshard import load as loader

        loader.READERS = a.readers
    src, out = a.work / "src", a.work / "out"
    if not src.exists():
        fixture("gpt-oss", "gpt-oss-120b", src, layers=a.layers)
    if not (out / "moeshard.json").exists():
        convert(src, out, ep_size=EP, overwrite=True)
    info = read_manifest(out)["ranks"][RANK]
    files = [out / f["path"] for f in info["files"]]
    rows = []
    cache: dict = {}  # the engines' index cache: empty for the cold run, kept for the warm one
    for state in ("cold", "warm"):
        dropped = drop_caches() if state == "cold" else None
        if state == "warm":  # bring the rank's files into the page cache first
            del moeshard.load_rank(out, RANK, device="cuda").layers
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rw = moeshard.load_rank(out, RANK, device="cuda")
        torch.cuda.synchronize()
        t_a = time.perf_counter() - t0
        if state == "cold":
            drop_caches()
        t_read, t_h2d = limit(files)
        if state == "cold":
            drop_caches()
        else:
            engines_today(src, info["experts"], cache)  # source pages cached too
        t_b, b_bytes = engines_today(src, info["experts"], cache)
        lim = max(t_read, t_h2d)
        rows.append({"cache": state, "page_cache_dropped": dropped, "a_load_rank_s": round(t_a, 3),
                     "a_bytes_gb": round(rw.bytes_read / 1e9, 3), "b_engines_today_s": round(t_b, 3),
                     "b_bytes_gb": round(b_bytes / 1e9, 3), "c_read_pinned_s": round(t_read, 3),
                     "c_h2d_s": round(t_h2d, 3), "a_over_limit": round(t_a / lim, 2), "a_over_b": round(t_a / t_b, 2)})
        del rw
    report(rows, a.json_out, f"gpt-oss-120b, {a.layers} layers, EP {EP} rank {RANK} ({len(info['experts'])} "
           f"experts), {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
