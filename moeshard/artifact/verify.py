"""``moeshard verify``: re-hash every file of an artifact against its manifest. Torch-free."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from moeshard.artifact.manifest import Manifest, artifact_file
from moeshard.errors import MoeshardError
from moeshard.files import sha256_file


@dataclass
class FileCheck:
    path: str
    bytes: int
    ok: bool
    problem: str = ""


def check_file(out: Path, path: str, size: int, sha256: str) -> str:
    """The first problem of one listed file (outside the artifact, missing, size, sha256), or ''."""
    try:
        p = artifact_file(out, path)
    except MoeshardError as e:
        return f"refused: {e}"
    if not p.is_file():
        return "missing"
    if (found := p.stat().st_size) != size:
        return f"size: expected {size}, found {found}"
    if (h := sha256_file(p)) != sha256:
        return f"sha256: expected {sha256}, found {h}"
    return ""


def verify(out: Path, progress=None) -> list[FileCheck]:
    """One check per file the manifest lists: its first problem, or ok."""
    out = Path(out)
    m = Manifest.read(out)
    tick = progress or (lambda n, what: None)
    if hasattr(tick, "total"):
        tick.total(sum(f.bytes for f in m.files()))
    checks = []
    for f in m.files():
        problem = check_file(out, f.path, f.bytes, f.sha256)
        checks.append(FileCheck(f.path, f.bytes, not problem, problem))
        tick(f.bytes, f.path)
    return checks


def as_json(checks: list[FileCheck]) -> dict:
    return {"passed": all(c.ok for c in checks), "files": [asdict(c) for c in checks]}
