"""The artifact folder while it is written: a lock, a journal of finished files, atomic writes.

- ``OUT/.moeshard.lock`` is held (``flock``) for the whole conversion: a second convert into the
  same folder is refused; the kernel releases it if the process dies.
- ``OUT/.moeshard-incomplete/`` holds the plan's fingerprint and ``journal.jsonl``: one line per
  finished output file (path, bytes, sha256), appended after the file is fsync'ed and renamed
  into place. ``--resume`` reuses a journaled file only if its size and sha256 still match and
  the fingerprint (source files, arguments, tool version) is the same.
- Every file is written as ``NAME.tmp`` and renamed; leftover ``.tmp`` files are removed.
- The manifest is written last, then the journal and the lock are removed. A folder without
  ``moeshard.json`` is not an artifact.

Hash: SHA-256 (``hashlib``), computed by the writer as it writes (or from the file just written).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from moeshard.convert.io import sha256_file, write_json
from moeshard.convert.manifest import MANIFEST_NAME, is_artifact
from moeshard.errors import MoeshardError

LOCK_NAME = ".moeshard.lock"
STATE_DIR = ".moeshard-incomplete"
#: Fault injection for the crash tests: "N:KILL" or "N:INT" sends that signal to this process
#: half-way through writing the file after the N-th finished one (a power cut or a Ctrl-C).
FAULT_ENV = "MOESHARD_FAULT_AFTER_FILES"


def _maybe_fault(written: int, tmp: Path) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    n, _, sig = spec.partition(":")
    if written == int(n):
        import signal

        with open(tmp, "r+b") as f:  # leave a torn temporary file behind, as a crash would
            f.truncate(max(1, tmp.stat().st_size // 2))
        os.kill(os.getpid(), signal.SIGKILL if sig == "KILL" else signal.SIGINT)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OutputDir:
    """Owns ``out`` while a conversion writes it (use as a context manager)."""

    def __init__(self, out: Path, fingerprint: dict, *, overwrite: bool, resume: bool, process: int | None = None):
        """``process`` is this process's number when several convert together (torchrun): process
        0 locks and prepares the folder; the others only write their files and their journal."""
        self.out = Path(out)
        self.fingerprint = fingerprint
        self.overwrite, self.resume = overwrite, resume
        self.process = process
        self.journal = "journal.jsonl" if process is None else f"journal-{process}.jsonl"
        self.done: dict[str, dict] = {}
        self._pending: list = []  # background fsync + rename + hash + journal, one per written file
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeshard-finish")
        self._lock = None

    # -- life cycle ---------------------------------------------------------------------------
    def __enter__(self) -> "OutputDir":
        if self.process:  # a follower: process 0 has locked and prepared the folder
            if self.resume:
                self._load_journal(self.out / STATE_DIR)
            return self
        out = self.out
        if out.exists() and not out.is_dir():
            raise MoeshardError(f"{out}: exists and is not a folder")
        out.mkdir(parents=True, exist_ok=True)
        self._lock = open(out / LOCK_NAME, "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise MoeshardError(f"{out}: another moeshard convert is writing this folder (lock {LOCK_NAME} is held)")
        state = out / STATE_DIR
        others = [p for p in out.iterdir() if p.name not in (LOCK_NAME, STATE_DIR)]
        if self.resume and state.is_dir():
            self._load_journal(state)
        elif is_artifact(out) and not self.overwrite:
            self._release()
            raise MoeshardError(f"{out}: already holds a moeshard artifact; pass --overwrite to replace it"
                                if not self.resume else f"{out}: already a complete artifact; nothing to resume")
        elif (others or state.is_dir()) and not self.overwrite:
            self._release()
            raise MoeshardError(f"{out}: exists and is not empty; choose a new folder, pass --overwrite, or "
                                "--resume an interrupted conversion")
        else:
            (out / MANIFEST_NAME).unlink(missing_ok=True)  # first: no longer an artifact
            for p in others + ([state] if state.exists() else []):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        state.mkdir(exist_ok=True)
        write_json(state / "fingerprint.json", self.fingerprint)
        self._remove_tmp()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._finisher.shutdown(wait=True)
        self._remove_tmp()
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def _remove_tmp(self) -> None:
        for p in self.out.rglob("*.tmp"):
            p.unlink(missing_ok=True)

    def _load_journal(self, state: Path) -> None:
        try:
            old = json.loads((state / "fingerprint.json").read_text())
        except (OSError, json.JSONDecodeError):
            old = None
        if old != self.fingerprint:
            self._release()
            raise MoeshardError(f"{self.out}: --resume: the interrupted conversion used other sources or arguments "
                                f"({state / 'fingerprint.json'}); rerun with the same ones, or --overwrite")
        for journal in sorted(state.glob("journal*.jsonl")):
            for line in journal.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self.done[rec["path"]] = {"bytes": rec["bytes"], "sha256": rec["sha256"]}
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a torn last line from a crash: that file is redone

    # -- files ---------------------------------------------------------------------------------
    def reusable(self, rel: str) -> dict | None:
        """The record of ``rel`` if an earlier run finished it and it is intact, else None."""
        rec = self.done.get(rel)
        path = self.out / rel
        if rec is None or not path.is_file() or path.stat().st_size != rec["bytes"]:
            return None
        return rec if sha256_file(path) == rec["sha256"] else None

    def write(self, rel: str, writer) -> None:
        """Write ``out/rel`` through ``writer(tmp_path)``, which returns the file's sha256 (hex, or a
        future of it) or None; then, in a background thread while the caller goes on with the next file: fsync,
        rename into place, sha256 (if not given), journal. :meth:`records` waits for those and
        returns every finished file's record."""
        path = self.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            sha = writer(tmp)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise self._write_error(path, e) from None
        if os.environ.get(FAULT_ENV):  # crash tests: let the finished files reach the journal first
            for fut in self._pending:
                fut.result()
            _maybe_fault(len(self._pending), tmp)
        self._pending.append(self._finisher.submit(self._finish_file, rel, tmp, path, sha))

    def _finish_file(self, rel: str, tmp: Path, path: Path, sha: str | Future | None) -> None:
        try:
            fsync_path(tmp)
            os.replace(tmp, path)
        except OSError as e:
            raise self._write_error(path, e) from None
        if isinstance(sha, Future):  # the writer hashed the bytes as it wrote them
            sha = sha.result()
        rec = {"bytes": path.stat().st_size, "sha256": sha or sha256_file(path)}
        with open(self.out / STATE_DIR / self.journal, "a") as j:
            j.write(json.dumps({"path": rel, **rec}) + "\n")
            j.flush()
            os.fsync(j.fileno())
        self.done[rel] = rec

    @staticmethod
    def _write_error(path: Path, e: OSError) -> MoeshardError:
        hint = " (disk full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        return MoeshardError(f"{path}: write failed{hint}: {e.strerror or e}; no manifest was written, the files "
                             "finished so far are kept: free space and rerun with --resume")

    def records(self) -> dict[str, dict]:
        """Size and sha256 of every file finished (this run's and reused ones), once all are on disk."""
        for fut in self._pending:
            fut.result()
        return dict(self.done)

    def write_text(self, rel: str, text: str) -> None:
        """A small text file (index), written and journaled like the others."""
        self.write(rel, lambda tmp: tmp.write_text(text) and None)

    def copy(self, rel: str, src: Path) -> None:
        """A file copied unchanged (config files), written and journaled like the others."""
        self.write(rel, lambda tmp: shutil.copyfile(src, tmp) and None)

    def finish(self, manifest: dict) -> None:
        """Write the manifest (last), then drop the journal and the lock file."""
        write_json(self.out / MANIFEST_NAME, manifest)
        fsync_path(self.out / MANIFEST_NAME)
        shutil.rmtree(self.out / STATE_DIR, ignore_errors=True)
        (self.out / LOCK_NAME).unlink(missing_ok=True)


def check_free_space(out: Path, needed: int) -> None:
    """Refuse to start when the disk holding ``out`` has less than ``needed`` bytes free."""
    probe = Path(out)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise MoeshardError(f"{out}: needs about {needed / 1e9:.2f} GB more, but only {free / 1e9:.2f} GB are free "
                            "on that disk")
