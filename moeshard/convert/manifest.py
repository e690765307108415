"""The artifact manifest ``moeshard.json``: written last; a folder without it is not an artifact.

A manifest is input too: every path in it must be relative, normalized and inside the artifact
(:func:`read_manifest` refuses the rest), and every file is opened through :func:`artifact_file`,
which refuses symlinks that lead outside it. Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from moeshard.errors import MoeshardError
from moeshard.files import load_json
from moeshard.paths import check_relative, inside

MANIFEST_NAME = "moeshard.json"
SCHEMA_VERSION = 1
#: Where a conversion notes, for this machine only, the absolute path of its source (never listed
#: in the manifest, never pushed): ``validate`` finds the source there.
LOCAL_NAME = ".moeshard-local.json"


def manifest_files(m: dict) -> list[dict]:
    """Every file the manifest lists: rank files and indexes, common files and index, copied files."""
    common = m["common"]["files"] + [m["common"]["index"]] if m["common"] else []
    return [f for r in m["ranks"] for f in r["files"] + [r["index"]]] + common + m["copied"]


def source_label(src: dict) -> str:
    """How the manifest's source is named in public: ``org/name at commit <sha>`` or the local
    folder's name (never a local path)."""
    if src.get("repo_id"):
        return f"{src['repo_id']} at commit {src['commit']}"
    return f"a local checkpoint ({src.get('name') or 'unnamed'})"


def _check_paths(m: dict, where: str) -> None:
    """Refuse a manifest whose folders or files are not relative paths inside the artifact."""
    try:
        for r in m["ranks"]:
            check_relative(r["folder"], where, "ranks[].folder", "artifact")
        if m["common"]:
            check_relative(m["common"]["folder"], where, "common.folder", "artifact")
        for f in manifest_files(m):
            check_relative(f["path"], where, "path", "artifact")
            if not isinstance(f["bytes"], int) or not isinstance(f["sha256"], str):
                raise MoeshardError(f"{where}: {f['path']}: expected integer bytes and a sha256 string")
    except (KeyError, TypeError) as e:
        raise MoeshardError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None


def read_manifest(out: Path) -> dict:
    """The manifest of artifact folder ``out``; a MoeshardError when the folder does not exist, the
    manifest is missing or unreadable, or a path in it leads outside the artifact."""
    out = Path(out)
    if not out.exists():
        raise MoeshardError(f"{out}: does not exist (expected an artifact folder written by moeshard convert)")
    path = out / MANIFEST_NAME
    if not path.is_file():
        raise MoeshardError(f"{out}: not a moeshard artifact: {MANIFEST_NAME} is missing "
                            "(an interrupted or unfinished conversion leaves none)")
    m = load_json(path)
    if m.get("schema_version") != SCHEMA_VERSION:
        raise MoeshardError(f"{path}: schema_version: expected {SCHEMA_VERSION}, found {m.get('schema_version')!r}")
    _check_paths(m, str(path))
    return m


def artifact_file(out: Path, rel: str) -> Path:
    """``out / rel`` for a path of the manifest, refusing one that leads outside the artifact
    (``..``, absolute, or a symlink to elsewhere)."""
    return inside(out, rel, str(Path(out) / MANIFEST_NAME), "path", "artifact", allowed=out)


def is_artifact(path: Path) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()
