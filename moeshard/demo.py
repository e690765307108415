"""``moeshard demo``: a tiny checkpoint, converted and validated, in a folder that a second run
replaces, and nothing else: a demo never removes a file it did not make."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moeshard.errors import MoeshardError
from moeshard.files import load_json, write_json

#: What a demo run made in its folder: the source fixture's files (the artifact has its manifest).
MARKER = ".moeshard-demo.json"


@dataclass
class DemoResult:
    source: Path
    convert: object  # ConvertResult
    report: object  # ValidationReport


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() or p.is_symlink())


def clear_previous(out: Path) -> None:
    """Remove a previous demo's ``source/`` and ``artifact/`` from ``out``, refusing (before removing
    anything) a folder that holds anything else, or files the demo did not write."""
    from moeshard.artifact.output import previous_output, remove

    if not out.exists():
        return
    if not out.is_dir():
        raise MoeshardError(f"{out}: exists and is not a folder")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    marker = out / MARKER
    if not marker.is_file() or set(entries) - {MARKER, "source", "artifact"}:
        stray = [e for e in entries if e not in (MARKER, "source", "artifact")] or entries
        raise MoeshardError(f"{out}: holds {stray[0]}, which moeshard demo did not make; choose another folder (-o)")
    made = set(load_json(marker).get("source_files") or [])
    src = out / "source"
    stray = [f"source/{f}" for f in (_files(src) if src.is_dir() else []) if f not in made]
    ours, foreign = previous_output(out / "artifact")
    stray += [f"artifact/{f}" for f in foreign]
    if stray:
        raise MoeshardError(f"{out}: holds {stray[0]}, which moeshard demo did not make; move it or choose another "
                            "folder (-o)")
    for f in made:
        (src / f).unlink(missing_ok=True)
    for d in sorted((p for p in src.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) if src.is_dir() else []:
        d.rmdir()
    if src.is_dir():
        src.rmdir()
    remove(ours)
    if (out / "artifact").is_dir():
        (out / "artifact").rmdir()
    marker.unlink()


def run_demo(out: Path, family: str = "gpt-oss", ep_size: int = 2) -> DemoResult:
    """Write a tiny ``family`` checkpoint to ``out/source``, convert it with ``ep_size`` ranks into
    ``out/artifact`` and validate it."""
    from moeshard.convert.pipeline import convert
    from moeshard.fixtures import fixture
    from moeshard.validate import validate

    out = Path(out)
    clear_previous(out)
    out.mkdir(parents=True, exist_ok=True)
    src = out / "source"
    write_json(out / MARKER, {"source_files": []})  # first: a crash below leaves a folder a rerun may clear
    try:
        fixture(family, "tiny", src)
    finally:
        if src.is_dir():
            write_json(out / MARKER, {"source_files": _files(src)})
    res = convert(src, out / "artifact", ep_size=ep_size)
    return DemoResult(src, res, validate(res.out))
