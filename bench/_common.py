"""Shared by the benchmark scripts: the oracle helpers' import path and the result table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # _reference: vLLM's preparation


def cuda_block_scale_interleave(s):
    """FlashInfer's CUDA 128x4 interleave of one expert's scales (as the engines call it)."""
    from flashinfer import block_scale_interleave

    return block_scale_interleave(s.contiguous())


def report(rows: list[dict], json_out: Path | None, title: str = "") -> None:
    """Print rows as a ' | '-separated table (stdout) and write them as JSON."""
    if title:
        print(title)
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=2))
