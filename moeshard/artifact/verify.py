"""``moeshard verify``: re-hash every file of an artifact against its manifest, and say what was
verified of its source (re-hashing what a ranged Hub run read when a copy is at hand). Torch-free."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from moeshard.artifact.manifest import LOCAL_NAME, Manifest, artifact_file
from moeshard.checkpoints.ranged import RangeCache, parse_key, sha256_range, tensor_spans
from moeshard.errors import MoeshardError
from moeshard.files import load_json, sha256_file


@dataclass
class FileCheck:
    path: str
    bytes: int
    ok: bool
    problem: str = ""


@dataclass
class SourceCheck:
    """What was verified of the source: ``summary`` (from the manifest), and, for a ranged Hub
    source with a copy at ``copy``, how many recorded headers and tensors were re-hashed there
    (``checked``), not found in it (``absent``: a ranged cache holds only what its runs fetched),
    and each mismatch (``problems``)."""

    summary: str
    copy: str | None = None
    checked: int = 0
    absent: int = 0
    problems: list[str] = field(default_factory=list)


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


def source_summary(m: Manifest) -> str:
    """What the manifest says was verified of the source when it was read."""
    src = m.source
    if not src.repo_id:
        return f"{src.label()}: read from a local folder; sizes recorded, nothing hashed"
    if not src.ranged:
        return (f"{src.label()}: {len(src.files)} files downloaded whole by huggingface_hub (sizes checked; the "
                "Hub's sha256 / git sha1 recorded as it names the blobs, not recomputed)")
    shards = [r for r in src.files.values() if "header_sha256" in r]
    tensors = [t for r in shards for t in r["tensors"].values()]
    return (f"{src.label()}: {len(shards)} shards read by HTTP range, not whole: their headers and "
            f"{len(tensors)} tensors or expert rows ({sum(t['bytes'] for t in tensors)} bytes) with byte counts "
            "checked and sha256 recorded; the Hub's whole-file sha256 covers no range and was not checked")


def check_source(out: Path, source: Path | None = None, progress=None) -> SourceCheck:
    """:func:`source_summary`; for a ranged Hub source, each recorded header and tensor sha256
    compared with a copy of the source: ``source`` (a whole download, say), else the folder
    this machine converted from (its ranged cache), if any."""
    out = Path(out)
    m = Manifest.read(out)
    check = SourceCheck(source_summary(m))
    note = out / LOCAL_NAME
    if source is None and note.is_file() and isinstance(path := load_json(note).get("source"), str):
        source = Path(path) if Path(path).is_dir() else None
    if not m.source.ranged or source is None:
        return check
    check.copy = str(source)
    cache = RangeCache.at(source)
    shards = {name: rec for name, rec in m.source.files.items() if "header_sha256" in rec}
    tick = progress or (lambda n, what: None)
    if hasattr(tick, "total"):
        tick.total(sum(t["bytes"] for r in shards.values() for t in r["tensors"].values()))
    for name, rec in sorted(shards.items()):
        path = source / name
        if not path.is_file():
            check.absent += 1 + len(rec["tensors"])
            continue
        header, spans = tensor_spans(path)
        wanted = [("", 0, header, rec["header_sha256"], None)]
        for key, t in sorted(rec["tensors"].items()):
            tensor, rows = parse_key(key)
            if tensor not in spans:
                check.problems.append(f"{name}: {tensor}: not in {path}")
                continue
            a, b, shape = spans[tensor]
            if rows is not None:
                row = (b - a) // shape[0]
                a, b = a + rows[0] * row, a + rows[1] * row
            wanted.append((key, a, b, t["sha256"], t["bytes"]))
        for key, a, b, sha, size in wanted:
            what = f"{name}: {key or 'header'}"
            if cache is not None and not cache.covers(name, a, b):
                check.absent += 1
            elif size is not None and b - a != size:
                check.problems.append(f"{what}: {b - a} bytes in {source}, {size} recorded")
            elif (h := sha256_range(path, a, b)) != sha:
                check.problems.append(f"{what}: sha256 {h} in {source}, {sha} recorded")
            else:
                check.checked += 1
            tick(size or 0, name)
    return check


def as_json(checks: list[FileCheck], source: SourceCheck | None = None) -> dict:
    return {"passed": all(c.ok for c in checks) and not (source and source.problems),
            "files": [asdict(c) for c in checks], "source": asdict(source) if source else None}
