"""``moeshard verify``: re-hash every file of an artifact against its manifest. Torch-free."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from moeshard.convert.manifest import artifact_file, manifest_files, read_manifest
from moeshard.errors import MoeshardError
from moeshard.files import sha256_file


@dataclass
class FileCheck:
    path: str
    bytes: int
    ok: bool
    problem: str = ""


def verify(out: Path, progress=None) -> list[FileCheck]:
    """One check per manifest file: its first problem (outside the artifact, missing, size,
    sha256), or ok."""
    out = Path(out)
    m = read_manifest(out)
    tick = progress or (lambda n, what: None)
    checks = []
    for f in manifest_files(m):
        try:
            path = artifact_file(out, f["path"])
        except MoeshardError as e:
            checks.append(FileCheck(f["path"], f["bytes"], False, str(e).split(": ", 1)[1]))
            continue
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
