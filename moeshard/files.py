"""Small file helpers shared by every stage, torch-free: moeshard's one JSON spelling, atomic JSON
writes, JSON reads that fail in one line, and SHA-256 of a file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from moeshard.errors import MoeshardError


def json_text(obj) -> str:
    """The one JSON spelling of moeshard's files: sorted keys, indent 2, trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def write_json(path: Path, obj) -> None:
    """Write JSON atomically (temporary name, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json_text(obj))
    os.replace(tmp, path)


def load_json(path: Path) -> dict:
    """A JSON object from ``path``; a MoeshardError when it is missing, unreadable or not an object."""
    if not path.is_file():
        raise MoeshardError(f"{path}: missing (expected a JSON file)")
    try:
        doc = json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise MoeshardError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise MoeshardError(f"{path}: expected a JSON object, found {type(doc).__name__}")
    return doc


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()
