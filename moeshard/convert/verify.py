"""``moeshard verify``: re-hash every file of an artifact against its manifest."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from moeshard.convert.io import sha256_file
from moeshard.convert.manifest import read_manifest


@dataclass
class FileCheck:
    path: str
    bytes: int
    ok: bool
    problem: str = ""


def manifest_files(m: dict) -> list[dict]:
    """Every file the manifest lists: rank files and indexes, common files and index, copied files."""
    common = m["common"]["files"] + [m["common"]["index"]] if m["common"] else []
    return [f for r in m["ranks"] for f in r["files"] + [r["index"]]] + common + m["copied"]


def verify(out: Path, progress=None) -> list[FileCheck]:
    """One check per manifest file: its first problem (missing, size, sha256), or ok."""
    out = Path(out)
    m = read_manifest(out)
    tick = progress or (lambda n, what: None)
    checks = []
    for f in manifest_files(m):
        path = out / f["path"]
        if not path.is_file():
            checks.append(FileCheck(f["path"], f["bytes"], False, "missing"))
        elif (size := path.stat().st_size) != f["bytes"]:
            checks.append(FileCheck(f["path"], f["bytes"], False, f"size: expected {f['bytes']}, found {size}"))
        elif (h := sha256_file(path)) != f["sha256"]:
            checks.append(FileCheck(f["path"], f["bytes"], False, f"sha256: expected {f['sha256']}, found {h}"))
        else:
            checks.append(FileCheck(f["path"], f["bytes"], True))
        tick(f["bytes"], f["path"])
    return checks


def as_json(checks: list[FileCheck]) -> dict:
    return {"passed": all(c.ok for c in checks), "files": [asdict(c) for c in checks]}
