"""Conversion speed and memory on real layer sizes, side by side in one run (CPU).

For each case a real-size fixture is generated on the spot, then measured one after another:

- ``cp``: ``cp -r`` of the source folder plus ``sync`` (the physical limit on this machine);
- ``moeshard``: ``python -m moeshard convert SRC -o OUT --ep-size 8`` (fsyncs every file);
- ``per-expert loop``: what serving engines run today, over the same MoE layers: the layer read
  whole, then FlashInfer's index helpers with their cache applied one expert at a time (vLLM's
  GPT-OSS / ModelOpt NVFP4 preparation), scales interleaved per expert; nothing written.

Each runs as a child process whose /proc status is sampled every 20 ms: peak RssAnon (anonymous
memory) and peak RssFile (file pages mapped, e.g. safetensors' mmap) are reported separately.
Prints a table and writes it as JSON.

    python bench/convert_cpu.py --work /tmp/moeshard-bench --json-out bench-convert.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from _common import drop_caches, median, report, sample

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "gpt-oss-120b x2": ("gpt-oss", "gpt-oss-120b", 2),
    "gpt-oss-120b x8": ("gpt-oss", "gpt-oss-120b", 8),
    "deepseek-r1 x3": ("deepseek-r1-fp4", "deepseek-r1", 3),
}

LOOP = r'''
import sys, time, torch
from moeshard.checkpoints.families import detect, read_experts
from moeshard.checkpoints.source import Checkpoint
from moeshard.validate.engines import engine_interleave as per_expert, vllm_gpt_oss_trtllm, vllm_nvfp4_trtllm
with Checkpoint(sys.argv[1]) as ck:
    a = detect(ck); spec = a.spec(ck)
    for layer in spec.moe_layers:
        p = spec.prefix(layer)
        if spec.family.value == "gpt-oss":
            rd = lambda leaf: ck.read(f"{p}.{leaf}")
            vllm_gpt_oss_trtllm(rd("gate_up_proj_blocks"), rd("gate_up_proj_scales"), rd("gate_up_proj_bias"),
                                rd("down_proj_blocks"), rd("down_proj_scales"), rd("down_proj_bias"), 3072, 3072,
                                interleave=per_expert)
        else:
            c = read_experts(a, ck, spec, layer, 0, spec.num_experts)
            a13, a2 = a.input_scales(ck, spec, layer)
            vllm_nvfp4_trtllm(c.w13, c.w13_scale, c.w2, c.w2_scale, c.w1_scale_2, c.w2_scale_2, a13, a2,
                              interleave=per_expert)
    print(ck.bytes_read)
'''


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/moeshard-bench"))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds; the median is reported")
    a = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rows = []
    for case in a.cases.split(","):
        family, preset, layers = CASES[case]
        src = a.work / case.replace(" ", "-")
        shutil.rmtree(a.work, ignore_errors=True)
        a.work.mkdir(parents=True)
        subprocess.run([sys.executable, "-m", "moeshard", "fixture", family, "--preset", preset, "--layers",
                        str(layers), "-o", str(src)], check=True, env=env, capture_output=True)
        size = folder_bytes(src)
        runs: dict[str, list[dict]] = {"cp": [], "ms": [], "loop": []}
        for _ in range(a.repeats):  # alternate, so that a noisy disk hits every method alike
            drop_caches()
            runs["cp"].append(sample(["sh", "-c", f"cp -r '{src}' '{a.work / 'cp'}' && sync"]))
            shutil.rmtree(a.work / "cp")
            drop_caches()
            runs["ms"].append(sample([sys.executable, "-m", "moeshard", "convert", str(src), "-o", str(a.work / "out"),
                                      "--ep-size", "8", "--json"], env))
            shutil.rmtree(a.work / "out")
            drop_caches()
            runs["loop"].append(sample([sys.executable, "-c", LOOP, str(src)], env))
        cp, ms, loop = (median(runs[k]) for k in ("cp", "ms", "loop"))
        written = json.loads(ms["stdout"])["bytes_written"]
        expert_bytes = int(loop["stdout"].split()[-1])
        for name, r, nbytes in (("cp", cp, size), ("moeshard convert --ep-size 8", ms, written),
                                ("per-expert loop (no write)", loop, expert_bytes)):
            rows.append({"case": case, "method": name, "seconds": round(r["seconds"], 2), "runs": r["all_seconds"],
                         "gb": round(nbytes / 1e9, 2), "gb_per_s": round(nbytes / r["seconds"] / 1e9, 3),
                         "vs_cp": round(r["seconds"] / cp["seconds"], 2), "peak_anon_mb": round(r["anon_mb"]),
                         "peak_file_mb": round(r["file_mb"])})
        shutil.rmtree(a.work)
        print(f"{case}: done", file=sys.stderr)
    report(rows, a.json_out)


if __name__ == "__main__":
    main()
