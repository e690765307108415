"""The artifact folder while it is written: a lock, a journal of finished files, atomic writes.

(About 300 lines on purpose: every path by which a run creates or removes a file in the output
folder is in this one module, so that what moeshard may delete can be audited in one place.)

- ``OUT/.moeshard.lock`` is held (``flock``) for the whole conversion: a second convert into the
  same folder is refused; the kernel releases it if the process dies.
- ``OUT/.moeshard-incomplete/`` holds the plan's fingerprint and ``journal.jsonl``: one line per
  finished output file (path, bytes, sha256), appended after the file is fsync'ed and renamed
  into place. ``--resume`` reuses a journaled file only if its size and sha256 still match and
  the fingerprint (source files, arguments, tool version) is the same.
- Every file is written as ``NAME.tmp`` and renamed; leftover ``.tmp`` files are removed.
- The manifest is written last, then the journal is removed; the lock file goes on every exit.
  A folder without ``moeshard.json`` is not an artifact.
- ``--overwrite`` removes only what a previous run made (:func:`previous_output`) and refuses a
  folder holding anything else; nothing is created or removed before the checks pass.

Hash: SHA-256 (``hashlib``), computed by the writer as it writes (or from the file just written).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from moeshard.artifact.manifest import LOCAL_NAME, MANIFEST_NAME, Manifest, is_artifact
from moeshard.errors import MoeshardError
from moeshard.files import load_json, sha256_file, write_json

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


#: Files a run makes in every folder it writes: shards (any count), the index, temporaries.
_OWN_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.tmp)?|model\.safetensors\.index\.json(\.tmp)?")
_OWN_FOLDER = re.compile(r"rank-\d{5}|common")


def previous_output(out: Path) -> tuple[list[Path], list[str]]:
    """What a previous moeshard run left in ``out`` and what it did not make.

    Returns ``(ours, foreign)``: ``ours`` are the top-level entries a run makes (the manifest, the
    lock, the journal folder, the local note, ``rank-*/`` and ``common/`` holding only shard and
    index files, and the copied files the old manifest or journal lists); ``foreign`` names
    (relative to ``out``) everything else, symlinks included. A folder with neither a manifest
    nor a journal was not made by moeshard: all of it is foreign.
    """
    out = Path(out)
    if not out.is_dir():
        return [], []
    entries = sorted(out.iterdir())
    listed: set[str] = set()
    if (out / MANIFEST_NAME).is_file():
        try:
            listed |= {f.path for f in Manifest.from_json(load_json(out / MANIFEST_NAME)).files()}
        except MoeshardError:
            pass  # an unreadable manifest lists nothing: its files count as foreign
    for journal in sorted((out / STATE_DIR).glob("journal*.jsonl")) if (out / STATE_DIR).is_dir() else []:
        for line in journal.read_text(errors="replace").splitlines():
            try:
                listed.add(json.loads(line)["path"])
            except (ValueError, KeyError, TypeError):
                continue
    made_by_us = (out / MANIFEST_NAME).is_file() or (out / STATE_DIR).is_dir()
    ours, foreign = [], []
    for p in entries:
        name = p.name
        if not made_by_us and name != LOCK_NAME:
            foreign.append(name)
        elif p.is_symlink():
            foreign.append(name)
        elif name in (MANIFEST_NAME, LOCK_NAME, LOCAL_NAME) or (p.is_file() and (name in listed
                                                                                or name.endswith(".tmp"))):
            ours.append(p)
        elif name == STATE_DIR and p.is_dir():
            ours.append(p)
        elif _OWN_FOLDER.fullmatch(name) and p.is_dir():
            stray = [f"{name}/{q.name}" for q in sorted(p.iterdir())
                     if q.is_symlink() or not q.is_file() or not _OWN_FILE.fullmatch(q.name)]
            (foreign.extend(stray) if stray else ours.append(p))
        else:
            foreign.append(name)
    return ours, foreign


def remove(paths: list[Path]) -> None:
    """Remove these files and folders (entries :func:`previous_output` found to be ours)."""
    for p in paths:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


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
        self.replaced: list[str] = []  # what --overwrite removed (top-level names)
        self._pending: list = []  # background fsync + rename + hash + journal, one per written file
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeshard-finish")
        self._lock = None
        self._made_folder = False

    # -- life cycle ---------------------------------------------------------------------------
    def check(self) -> None:
        """Refuse, before anything is created or removed, an output that cannot be used: a file,
        an artifact (without --overwrite), a non-empty folder, or (with --overwrite) one holding
        anything a previous moeshard run did not make."""
        out = self.out
        if out.exists() and not out.is_dir():
            raise MoeshardError(f"{out}: exists and is not a folder")
        state = out / STATE_DIR
        if self.resume and state.is_dir():
            return
        if is_artifact(out) and not self.overwrite:
            raise MoeshardError(f"{out}: already a complete artifact; nothing to resume" if self.resume else
                                f"{out}: already holds a moeshard artifact; pass --overwrite to replace it")
        ours, foreign = previous_output(out)
        if foreign:
            more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
            raise MoeshardError(
                f"{out}: holds {foreign[0]}{more}, not made by moeshard; --overwrite replaces only a previous "
                "moeshard output: choose a new folder or move those files" if self.overwrite else
                f"{out}: exists and is not empty; choose a new folder, pass --overwrite (replaces a previous moeshard "
                "output), or --resume an interrupted conversion")
        if any(p.name != LOCK_NAME for p in ours) and not self.overwrite:
            raise MoeshardError(f"{out}: exists and is not empty; choose a new folder, pass --overwrite, or "
                                "--resume an interrupted conversion")

    def __enter__(self) -> OutputDir:
        if self.process:  # a follower: process 0 has locked and prepared the folder
            if self.resume:
                self._load_journal(self.out / STATE_DIR)
            return self
        self.check()
        out = self.out
        self._made_folder = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / LOCK_NAME, "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise MoeshardError(f"{out}: another moeshard convert is writing this folder (lock {LOCK_NAME} is held)"
                                ) from None
        self._lock = lock
        try:
            self.check()  # again, under the lock: another run may have changed the folder meanwhile
            state = out / STATE_DIR
            if self.resume and state.is_dir():
                self._load_journal(state)
            else:
                ours = [p for p in previous_output(out)[0] if p.name != LOCK_NAME]
                (out / MANIFEST_NAME).unlink(missing_ok=True)  # first: no longer an artifact
                remove(ours)
                self.replaced = sorted(p.name for p in ours)
            state.mkdir(exist_ok=True)
            write_json(state / "fingerprint.json", self.fingerprint)
            self._remove_tmp()
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._finisher.shutdown(wait=True)
        self._remove_tmp()
        self._release()

    def _release(self) -> None:
        """Drop the lock and its file; remove the folder too if this run made it and left it empty."""
        if self._lock is None:
            return
        (self.out / LOCK_NAME).unlink(missing_ok=True)
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()
        self._lock = None
        if self._made_folder and self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()

    def _remove_tmp(self) -> None:
        for p in self.out.rglob("*.tmp"):
            if not p.is_symlink():
                p.unlink(missing_ok=True)

    def _load_journal(self, state: Path) -> None:
        try:
            old = json.loads((state / "fingerprint.json").read_text())
        except (OSError, json.JSONDecodeError):
            old = None
        if old != self.fingerprint:
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

    def finish(self, manifest: Manifest, local: dict) -> None:
        """Write the manifest (last), this machine's note (:data:`LOCAL_NAME`), then drop the journal."""
        write_json(self.out / MANIFEST_NAME, manifest.to_json())
        fsync_path(self.out / MANIFEST_NAME)
        write_json(self.out / LOCAL_NAME, local)
        shutil.rmtree(self.out / STATE_DIR, ignore_errors=True)


def check_free_space(out: Path, needed: int) -> None:
    """Refuse to start when the disk holding ``out`` has less than ``needed`` bytes free."""
    probe = Path(out)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise MoeshardError(f"{out}: needs about {needed / 1e9:.2f} GB more, but only {free / 1e9:.2f} GB are free "
                            "on that disk")
