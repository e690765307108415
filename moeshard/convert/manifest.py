"""The artifact manifest ``moeshard.json``: written last; a folder without it is not an artifact."""

from __future__ import annotations

import json
from pathlib import Path

from moeshard.errors import MoeshardError

MANIFEST_NAME = "moeshard.json"
SCHEMA_VERSION = 1


def read_manifest(out: Path) -> dict:
    """The manifest of artifact folder ``out``; a MoeshardError when it is missing or unreadable."""
    path = Path(out) / MANIFEST_NAME
    if not path.is_file():
        raise MoeshardError(f"{out}: not a moeshard artifact: {MANIFEST_NAME} is missing "
                            "(an interrupted or unfinished conversion leaves none)")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MoeshardError(f"{path}: invalid JSON: {e}") from None
    if m.get("schema_version") != SCHEMA_VERSION:
        raise MoeshardError(f"{path}: schema_version: expected {SCHEMA_VERSION}, found {m.get('schema_version')!r}")
    return m


def is_artifact(path: Path) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()
