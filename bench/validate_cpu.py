"""``moeshard validate`` on the CPU: today's validation against the one before it, side by side.

One real-size MoE layer (gpt-oss-120b by default: 128 experts, H = I = 2880) converted with
--ep-size 8, validated over all 8 ranks with the decode backend, each run a whole CLI process
with its peak anonymous and file-mapped memory sampled:

- ``moeshard``: this tree (``python -m moeshard validate``);
- ``before``: a checkout of the commit before (``--before-tree``, e.g. a ``git worktree`` of
  85f75bd), which validates an artifact it converted itself.

The page cache is dropped before each run when allowed; otherwise both read warm. Prints a table.

    git worktree add /tmp/base 85f75bd
    python bench/validate_cpu.py --work /tmp/moeshard-bench --before-tree /tmp/base
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from _common import drop_caches, median, report, sample

ROOT = Path(__file__).resolve().parents[1]
CASES = {"gpt-oss-120b": ("gpt-oss", "gpt-oss-120b", 1), "deepseek-r1": ("deepseek", "deepseek-r1", 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/moeshard-bench"))
    ap.add_argument("--before-tree", type=Path, default=None, help="a checkout of the version to compare with")
    ap.add_argument("--case", default="gpt-oss-120b", choices=list(CASES))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json-out", type=Path, default=None)
    a = ap.parse_args()
    family, preset, layers = CASES[a.case]
    src = a.work / f"{a.case}-src"
    trees = {"moeshard": ROOT, **({"before": a.before_tree} if a.before_tree else {})}
    # each version runs in its own tree (``python -m`` puts the working directory first on sys.path)
    env = {name: dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
           for name, tree in trees.items()}
    if not src.exists():
        sample([sys.executable, "-m", "moeshard", "fixture", family, "--preset", preset, "--layers", str(layers),
                "-o", str(src)], env["moeshard"], ROOT)
    outs = {}
    for name in trees:
        outs[name] = a.work / f"{a.case}-{name}-out"
        if not (outs[name] / "moeshard.json").exists():
            sample([sys.executable, "-m", "moeshard", "convert", str(src), "-o", str(outs[name]), "--ep-size", "8",
                    "-q", "--overwrite"], env[name], trees[name])
    layer = "1" if family == "deepseek" else "0"
    runs = {name: [] for name in trees}
    for _ in range(a.rounds):
        for name in trees:
            drop_caches()
            runs[name].append(sample([sys.executable, "-m", "moeshard", "validate", str(outs[name]), "--layers", layer,
                                      "--tokens", str(a.tokens), "--json", "-q"], env[name], trees[name]))
    base = median(runs["before"])["seconds"] if "before" in runs else None
    rows = []
    for name, rs in runs.items():
        r = median(rs)
        rows.append({"case": a.case, "version": name, "ranks": 8, "tokens": a.tokens, "seconds": round(r["seconds"], 1),
                     "runs": r["all_seconds"], "speedup_vs_before": round(base / r["seconds"], 2) if base else None,
                     "peak_anon_mb": round(r["anon_mb"]), "peak_file_mb": round(r["file_mb"])})
    report(rows, a.json_out, title=f"validate one {a.case} layer over 8 ranks on the CPU")


if __name__ == "__main__":
    main()
