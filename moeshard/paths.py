"""Path safety: what moeshard reads stays inside the folder it was given, and what it writes never
overlaps a source. Torch-free (``verify``, ``inspect`` and ``push`` import it).

- A relative name from a file (an index's ``weight_map``, a manifest's ``path``) must be relative,
  normalized and free of ``..``: :func:`check_relative` refuses the rest before anything is opened.
- A symlink is followed only when it resolves inside the folder it belongs to, or, for a Hub cache
  snapshot (``models--org--name/snapshots/<commit>/``), inside that repo's cache folder, where
  the snapshot's links point into ``blobs/`` (:func:`inside`).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from moeshard.errors import MoeshardError


def real(path: Path | str) -> Path:
    """``path`` with every symlink and ``..`` resolved (the part that exists; the rest appended)."""
    return Path(os.path.realpath(path))


def is_within(path: Path | str, root: Path | str) -> bool:
    """Whether real ``path`` is real ``root`` or lies under it."""
    p, r = real(path), real(root)
    return p == r or r in p.parents


def overlaps(a: Path | str, b: Path | str) -> bool:
    """Whether one folder is, contains or lies inside the other once links and ``..`` are resolved."""
    return is_within(a, b) or is_within(b, a)


def hub_repo_root(folder: Path | str) -> Path | None:
    """``.../models--org--name`` when ``folder`` is a Hub cache snapshot
    (``.../models--org--name/snapshots/<commit>``), else None."""
    f = Path(os.path.abspath(folder))
    if f.parent.name == "snapshots" and f.parent.parent.name.startswith("models--"):
        return f.parent.parent
    return None


def check_relative(rel: str, where: str, what: str = "path", kind: str = "checkpoint") -> str:
    """``rel`` if it is a relative, normalized POSIX path without ``..``; else a MoeshardError
    naming ``where`` (the file it came from), ``what`` (the field) and ``kind`` (the folder)."""
    p = PurePosixPath(rel) if isinstance(rel, str) else None
    if (p is None or not rel or p.is_absolute() or ".." in p.parts or str(p) != rel or "\\" in rel
            or rel.startswith("~")):
        raise MoeshardError(f"{where}: {what} {rel!r} points outside the {kind}: expected a relative path "
                            "without '..'")
    return rel


def inside(root: Path | str, rel: str, where: str, what: str = "path", kind: str = "checkpoint",
           allowed: Path | str | None = None) -> Path:
    """``root / rel`` after :func:`check_relative`, refusing a symlink (on the way or at the end)
    that resolves outside ``allowed`` (default: ``root``; a Hub snapshot's repo cache folder)."""
    check_relative(rel, where, what, kind)
    path = Path(root) / rel
    allowed = allowed if allowed is not None else (hub_repo_root(root) or root)
    if not is_within(path, allowed):
        raise MoeshardError(f"{path}: a symlink to {real(path)}, outside the {kind} ({real(allowed)}); "
                            f"copy the file into the {kind} folder instead")
    return path
