"""Time ``moeshard validate --backend decode --device cuda`` on one real-size MoE layer.

Generates real-size fixtures on the spot (gpt-oss-120b: 1 layer, 128 experts; DeepSeek-R1:
1 dense + 1 MoE layer, 256 experts), converts them with --ep-size 8, then times validating the
MoE layer over all 8 ranks (every expert) with 64 tokens, including reading the files.
Prints a table; writes the figures as JSON next to the outputs.

    python bench/validate_gpu.py --work /tmp/bench --json-out bench-validate.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _common import report

from moeshard.convert.pipeline import convert
from moeshard.fixtures import fixture
from moeshard.validate import validate

CASES = {"gpt-oss-120b": ("gpt-oss", "gpt-oss-120b", 1), "deepseek-r1": ("deepseek-r1-fp4", "deepseek-r1", 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/moeshard-bench"))
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    rows = []
    for name in a.cases.split(","):
        family, preset, layers = CASES[name]
        src, out = a.work / f"{name}-src", a.work / f"{name}-out"
        t0 = time.perf_counter()
        if not src.exists():
            fixture(family, preset, src, layers=layers)
        t_fix = time.perf_counter() - t0
        res = convert(src, out, ep_size=8, overwrite=True)
        layer = res.manifest.moe_layers[0].layer
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = validate(out, layers=[layer], tokens=a.tokens, backend="decode", device="cuda")
        torch.cuda.synchronize()
        t_val = time.perf_counter() - t0
        rows.append({"case": name, "experts": res.manifest.num_experts, "ranks": 8, "tokens": a.tokens,
                     "fixture_s": round(t_fix, 2), "convert_s": round(res.seconds, 2),
                     "validate_s": round(t_val, 2), "passed": result.passed,
                     "max_rel_error": max(r.rel_error for r in result.rows),
                     "gpu": torch.cuda.get_device_name()})
    report(rows, a.json_out)


if __name__ == "__main__":
    main()
