"""Shared by the benchmark scripts: running a command while sampling its memory, the page cache,
and the result table."""

from __future__ import annotations

import json
import subprocess
import time
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


def sample(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> dict:
    """Run cmd (in ``cwd``), sampling its /proc status; seconds, peak anon/file RSS in MB, stdout."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    peak = {"RssAnon": 0, "RssFile": 0}
    while p.poll() is None:
        try:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                k, _, v = line.partition(":")
                if k in peak:
                    peak[k] = max(peak[k], int(v.split()[0]))
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    out, err = p.communicate()
    if p.returncode:
        raise RuntimeError(f"{cmd} failed: {err[-2000:]}")
    return {"seconds": time.perf_counter() - t0, "anon_mb": peak["RssAnon"] / 1024, "file_mb": peak["RssFile"] / 1024,
            "stdout": out}


def median(runs: list[dict]) -> dict:
    """The run of median time, with the largest peak memory seen over all runs."""
    r = dict(sorted(runs, key=lambda x: x["seconds"])[len(runs) // 2])
    r["anon_mb"] = max(x["anon_mb"] for x in runs)
    r["file_mb"] = max(x["file_mb"] for x in runs)
    r["all_seconds"] = [round(x["seconds"], 2) for x in runs]
    return r


def drop_caches() -> None:
    subprocess.run(["sync"])
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass  # not permitted here: both cp and moeshard then read a warm page cache
