"""Shared by the benchmark scripts: the result table."""

from __future__ import annotations

import json
from pathlib import Path


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
