"""Reading a Hub checkpoint by HTTP ranges: a rank fetches only the bytes it reads.

A repo id converted rank by rank (``--ranks``, or the processes of a torchrun run) is not
downloaded whole. Its configs and index come by ``snapshot_download`` (small files); then the
safetensors header of every shard the index names is read by HTTP range, the plan is made from
those headers (an index can be incomplete), and only the byte ranges of the tensors and expert
rows the run reads are fetched, neighbouring ranges coalesced (:func:`coalesce`). The requests
are the hub's own: ``hf_hub_url`` at the resolved commit (``HF_ENDPOINT``), ``build_hf_headers``
(the token) and ``http_backoff`` (retries on 408/429/5xx and broken connections). No layer of
huggingface_hub checks the length of a 206, so every answer's ``Content-Range`` and length are
checked here, and what a short answer left out is asked for again.

The ranges are kept beside the hub's cache of the repo, in
``HF_HUB_CACHE/models--org--name/moeshard-ranges/<commit>/``: the configs, and each shard as a
sparse file of its real name and size holding only the ranges fetched, so that every offset and
safetensors' memory map work as on the whole file. ``.moeshard-ranges/journal.jsonl`` lists the
ranges on disk, appended only after their bytes are synced: a re-run or ``--resume`` fetches
nothing twice, an interrupted range resumes from its last piece, and a
:class:`~moeshard.checkpoints.source.Checkpoint` over the folder refuses to read a byte outside
them. One process at a time fetches into a folder (``flock``). Torch-free.
"""

from __future__ import annotations

import bisect
import fcntl
import hashlib
import json
import os
import re
import shutil
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from moeshard.errors import MoeshardError
from moeshard.paths import check_relative

#: The state folder inside a ranged cache folder, and the cache folders' place in a repo's cache.
STATE_DIR = ".moeshard-ranges"
CACHE_DIR = "moeshard-ranges"
#: The most bytes one request asks for: memory stays below ``max_workers`` pieces.
PIECE_BYTES = 8 << 20
#: A gap between two wanted ranges is read through when it is at most SMALL_GAP bytes (fewer than
#: the HTTP headers of another request), or, smallest first, when it is at most MAX_GAP bytes
#: (another request costs a round trip) while all such gaps stay within GAP_FRACTION of the run's
#: own bytes.
SMALL_GAP = 512
MAX_GAP = 1 << 20
GAP_FRACTION = 0.05
#: Concurrent requests (huggingface_hub's ``max_workers`` default).
MAX_WORKERS = 8
#: ``http_backoff``'s first wait between retries, in seconds (it doubles, up to 8 s; tests shorten it).
RETRY_WAIT = 1.0
#: Consecutive answers shorter than asked before a range is given up.
MAX_SHORT = 8
#: Fetched pieces are synced and journaled at least this often (seconds).
COMMIT_SECONDS = 1.0
_KEY = re.compile(r"(.*)\[(\d+):(\d+)\]")


@dataclass(frozen=True)
class Part:
    """A byte range ``[start, stop)`` of shard ``file`` that a run reads: tensor ``name`` whole, or
    its expert rows ``rows`` (dim 0). ``own``: only this run's ranks read it (their experts), not
    every rank (routers, activation scales, common tensors)."""

    file: str
    start: int
    stop: int
    name: str
    rows: tuple[int, int] | None = None
    own: bool = False

    @property
    def key(self) -> str:
        """How the manifest names it: ``name``, or ``name[a:b]`` for expert rows a..b-1."""
        return self.name if self.rows is None else f"{self.name}[{self.rows[0]}:{self.rows[1]}]"


def parse_key(key: str) -> tuple[str, tuple[int, int] | None]:
    """``name`` / ``name[a:b]`` -> (name, rows)."""
    m = _KEY.fullmatch(key)
    return (key, None) if m is None else (m.group(1), (int(m.group(2)), int(m.group(3))))


@dataclass
class Transfer:
    """What a ranged run moved: ``share`` bytes of the parts only its ranks read, ``shared`` bytes
    of the others (routers, activation scales, common/ tensors), ``headers`` bytes of the shards' headers, ``fetched`` body
    bytes received by this run in ``requests`` answers (the rest was in the cache), and ``whole``
    bytes of the shards holding those parts (what downloading whole shards would move), in
    ``seconds`` of fetching."""

    share: int = 0
    shared: int = 0
    headers: int = 0
    fetched: int = 0
    requests: int = 0
    whole: int = 0
    seconds: float = 0.0

    def __add__(self, o: Transfer) -> Transfer:
        return Transfer(*(a + b for a, b in zip(self.__dict__.values(), o.__dict__.values())))

    def to_json(self) -> dict:
        rate = self.fetched / self.seconds if self.seconds > 0 else 0.0
        return {**self.__dict__, "saved": self.whole - self.fetched, "seconds": round(self.seconds, 3),
                "rate_mb_s": round(rate / 1e6, 1)}


class Spans:
    """Disjoint, sorted ``[start, stop)`` byte ranges of one file."""

    def __init__(self):
        self.starts: list[int] = []
        self.stops: list[int] = []

    def add(self, a: int, b: int) -> None:
        i = bisect.bisect_left(self.stops, a)  # first span that ends at or after a
        j = bisect.bisect_right(self.starts, b)  # spans from i to j-1 touch [a, b)
        if i < j:
            a, b = min(a, self.starts[i]), max(b, self.stops[j - 1])
        self.starts[i:j], self.stops[i:j] = [a], [b]

    def missing(self, a: int, b: int) -> list[tuple[int, int]]:
        """The parts of ``[a, b)`` not covered."""
        out, pos = [], a
        for k in range(max(0, bisect.bisect_right(self.stops, a)), len(self.starts)):
            if self.starts[k] >= b:
                break
            if self.starts[k] > pos:
                out.append((pos, self.starts[k]))
            pos = max(pos, self.stops[k])
        if pos < b:
            out.append((pos, b))
        return out

    def covers(self, a: int, b: int) -> bool:
        return not self.missing(a, b)

    def __iter__(self):
        return zip(self.starts, self.stops)


def coalesce(ranges: dict[str, list[tuple[int, int]]], budget: int, have: dict[str, Spans] | None = None,
             small: int = SMALL_GAP, large: int = MAX_GAP) -> dict[str, list[tuple[int, int]]]:
    """Per file, sorted disjoint ``ranges`` joined across gaps: every gap of at most ``small``
    bytes, then, smallest first, gaps of at most ``large`` bytes while their sum stays within
    ``budget`` bytes; never a gap that holds bytes of ``have`` (already fetched)."""
    have = have or {}
    gaps = sorted((b[0] - a[1], f, k) for f, rs in ranges.items() for k, (a, b) in enumerate(zip(rs, rs[1:]))
                  if f not in have or have[f].missing(a[1], b[0]) == [(a[1], b[0])])
    join, spent = set(), 0
    for size, f, k in gaps:
        if size <= small or (size <= large and spent + size <= budget):
            join.add((f, k))
            spent += size if size > small else 0
    out = {}
    for f, rs in ranges.items():
        merged = [list(rs[0])] if rs else []
        for k in range(1, len(rs)):
            if (f, k - 1) in join:
                merged[-1][1] = rs[k][1]
            else:
                merged.append(list(rs[k]))
        out[f] = [(a, b) for a, b in merged]
    return out


def _content_range(r, pos: int, size: int, what: str) -> None:
    """Check that answer ``r`` holds bytes from ``pos`` on of a file of ``size`` bytes, and that its
    body is as long as its ``Content-Range`` says."""
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", r.headers.get("Content-Range", ""))
    if r.status_code != 206 or m is None:
        raise MoeshardError(f"{what}: expected a 206 answer with a Content-Range, found HTTP {r.status_code} "
                            f"{r.headers.get('Content-Range', 'without one')}: the server ignores ranges")
    a, b, total = int(m.group(1)), int(m.group(2)), m.group(3)
    if a != pos or b - a + 1 != len(r.content) or (total != "*" and int(total) != size):
        raise MoeshardError(f"{what}: expected bytes from {pos} of a {size}-byte file, found Content-Range "
                            f"{r.headers['Content-Range']} with {len(r.content)} bytes")


class RangeCache:
    """A folder of sparse shards (the module docstring): what is on disk (:meth:`covers`) and,
    opened with :meth:`open`, the fetching of missing ranges from the Hub (:meth:`fetch`)."""

    def __init__(self, root: Path, repo_id: str | None = None, commit: str | None = None,
                 token: str | bool | None = None, max_workers: int = MAX_WORKERS):
        self.root = Path(root)
        self.state = self.root / STATE_DIR
        self.repo_id, self.commit, self.token = repo_id, commit, token
        self.max_workers = max(1, max_workers)
        self.spans: dict[str, Spans] = {}
        self.files: dict[str, dict] = {}  # name -> the Hub's {"bytes", "sha256" | "git_sha1"}
        self.transfer = Transfer()
        self._count = threading.Lock()

    # -- the cache on disk --------------------------------------------------------------------------
    @classmethod
    def at(cls, root: Path) -> RangeCache | None:
        """The ranged cache at ``root``, or None when ``root`` is not one."""
        if not (Path(root) / STATE_DIR / "files.json").is_file():
            return None
        cache = cls(root)
        cache.load()
        return cache

    def load(self) -> None:
        """Read the Hub's file listing and the journal (a torn last line, from a crash, is skipped)."""
        self.files = json.loads((self.state / "files.json").read_text())
        self.spans = {}
        journal = self.state / "journal.jsonl"
        for line in journal.read_text().splitlines() if journal.is_file() else []:
            try:
                f, a, b = json.loads(line)
            except ValueError:
                continue
            self.spans.setdefault(f, Spans()).add(a, b)

    def covers(self, file: str, a: int, b: int) -> bool:
        """Whether bytes ``[a, b)`` of ``file`` are on disk (the journal is read again on a miss:
        another process, or another instance, may have fetched them since)."""
        if b <= a or (file in self.spans and self.spans[file].covers(a, b)):
            return True
        self.load()
        return file in self.spans and self.spans[file].covers(a, b)

    @contextmanager
    def _locked(self):
        """One process at a time changes the folder."""
        self.state.mkdir(parents=True, exist_ok=True)
        with open(self.state / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if (self.state / "files.json").is_file():  # what other processes fetched meanwhile
                    self.load()
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # -- opening: configs, listing, headers -----------------------------------------------------------
    @staticmethod
    def folder(commit: str) -> str:
        """Where the ranged cache of ``commit`` lies in the hub's cache folder of its repo."""
        return f"{CACHE_DIR}/{commit}"

    @classmethod
    def open(cls, repo_id: str, commit: str, meta: Path, repo_cache: Path, token: str | bool | None = None,
             max_workers: int = MAX_WORKERS) -> RangeCache:
        """The ranged cache of ``repo_id`` at ``commit`` in ``repo_cache`` (the hub's
        ``models--org--name`` folder), made ready for a plan: the small files of the snapshot
        ``meta`` copied in, the Hub's listing of the commit, and the header of every shard the
        index names (or ``model.safetensors``), each shard a sparse file of its real size."""
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile

        from moeshard.checkpoints.safetensors_io import INDEX_NAME, SINGLE_NAME

        cache = cls(repo_cache / cls.folder(commit), repo_id, commit, token, max_workers)
        with cache._locked():
            for p in sorted(meta.iterdir()):
                if p.is_file() and not (cache.root / p.name).is_file():
                    shutil.copyfile(p, cache.root / f"{p.name}.tmp")
                    os.replace(cache.root / f"{p.name}.tmp", cache.root / p.name)
            if not (cache.state / "files.json").is_file():
                listing = {e.path: {"bytes": e.size, **({"sha256": e.lfs.sha256} if e.lfs else {"git_sha1": e.blob_id})}
                           for e in HfApi().list_repo_tree(repo_id, revision=commit, token=token)
                           if isinstance(e, RepoFile)}
                (cache.state / "files.json.tmp").write_text(json.dumps(listing, sort_keys=True))
                os.replace(cache.state / "files.json.tmp", cache.state / "files.json")
                cache.load()
            index = meta / INDEX_NAME
            if index.is_file():
                from moeshard.files import load_json

                weight_map = load_json(index).get("weight_map")
                if not isinstance(weight_map, dict) or not weight_map:
                    raise MoeshardError(f"{index}: expected a non-empty 'weight_map'")
                shards = sorted({check_relative(str(f), f"{index}: weight_map", "file") for f in weight_map.values()})
            else:
                shards = [SINGLE_NAME]
            for name in shards:
                if name not in cache.files:
                    raise MoeshardError(f"{repo_id}: {name} is not in the repository at commit {commit} "
                                        f"(expected by {INDEX_NAME if index.is_file() else 'a checkpoint'})")
            cache._fetch_headers(shards)
        return cache

    def _shard(self, name: str) -> int:
        """The file descriptor of shard ``name`` (a sparse file of its real size), opened for writing."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(fd).st_size != self.files[name]["bytes"]:
            os.ftruncate(fd, self.files[name]["bytes"])
        return fd

    def header_bytes(self, name: str) -> int:
        """8 + the header length of shard ``name`` (its first bytes must be in the cache)."""
        with open(self.root / name, "rb") as f:
            return 8 + struct.unpack("<Q", f.read(8))[0]

    def _fetch_headers(self, shards: list[str]) -> None:
        """Fetch the 8-byte length, then the JSON header, of every shard not yet in the cache."""
        from moeshard.checkpoints.safetensors_io import header_length

        todo = [s for s in shards if not self.covers(s, 0, 8)]
        self._get_all({s: [(0, min(8, self.files[s]["bytes"]))] for s in todo}, None)
        ends = {}
        for s in shards:
            with open(self.root / s, "rb") as f:
                ends[s] = 8 + header_length(self.root / s, f.read(8), self.files[s]["bytes"])
        todo = {s: [(8, ends[s])] for s in shards if not self.covers(s, 8, ends[s])}
        self._get_all(todo, None)
        with self._count:
            self.transfer.headers += sum(ends.values())

    # -- fetching ------------------------------------------------------------------------------------
    def missing(self, parts: list[Part]) -> dict[str, list[tuple[int, int]]]:
        """Per file, the sorted ranges of ``parts`` not in the cache."""
        want: dict[str, Spans] = {}
        for p in parts:
            want.setdefault(p.file, Spans()).add(p.start, p.stop)
        out = {}
        for f, spans in want.items():
            have = self.spans.get(f, Spans())
            if got := [m for a, b in spans for m in have.missing(a, b)]:
                out[f] = got
        return out

    def fetch(self, parts: list[Part], progress: Callable | None = None) -> dict[str, dict]:
        """Fetch what of ``parts`` is not in the cache (gaps coalesced: :func:`coalesce`), then
        return per shard what was read: ``{"header_sha256", "tensors": {part key: {"bytes",
        "sha256"}}}``. ``progress(n, what)`` as bytes arrive (``progress.total(n)`` first)."""
        with self._locked():
            share = sum(p.stop - p.start for p in {(p.file, p.start, p.stop): p for p in parts}.values() if p.own)
            todo = coalesce(self.missing(parts), int(GAP_FRACTION * share), self.spans)
            if progress is not None and hasattr(progress, "total"):
                progress.total(sum(b - a for rs in todo.values() for a, b in rs))
            self._get_all(todo, progress)
            hashes = self._hashes(parts)
        files = {p.file for p in parts}
        with self._count:
            t = self.transfer
            unique = {(p.file, p.start, p.stop): p for p in parts}.values()
            t.share += sum(p.stop - p.start for p in unique if p.own)
            t.shared += sum(p.stop - p.start for p in unique if not p.own)
            t.whole += sum(self.files[f]["bytes"] for f in files)
        return hashes

    def _get_all(self, ranges: dict[str, list[tuple[int, int]]], progress: Callable | None) -> None:
        """Fetch ``ranges`` in pieces of at most :data:`PIECE_BYTES`, ``max_workers`` at a time,
        into the sparse shards; the pieces done are synced and journaled every
        :data:`COMMIT_SECONDS` and when the work stops (finished, failed or interrupted)."""
        pieces = [(f, a, min(a + PIECE_BYTES, b)) for f, rs in ranges.items() for s, b in rs
                  for a in range(s, b, PIECE_BYTES)]
        if not pieces:
            return
        fds = {f: self._shard(f) for f in ranges}
        done: list[tuple[str, int, int]] = []
        t0 = last = time.monotonic()
        try:
            with ThreadPoolExecutor(self.max_workers, thread_name_prefix="moeshard-fetch") as pool:
                pending = {pool.submit(self._get, fds[f], f, a, b, progress): (f, a, b) for f, a, b in pieces}
                try:
                    while pending:
                        finished, _ = wait(pending, timeout=COMMIT_SECONDS, return_when=FIRST_EXCEPTION)
                        for fut in finished:
                            piece = pending.pop(fut)
                            fut.result()  # raises the first failure (after its retries)
                            done.append(piece)
                        if time.monotonic() - last >= COMMIT_SECONDS:
                            self._commit(fds, done)
                            last = time.monotonic()
                except BaseException:
                    for fut in pending:
                        fut.cancel()
                    for fut in list(pending):  # those running finish (or fail); keep what arrived
                        if not fut.cancelled() and fut.exception() is None:
                            done.append(pending[fut])
                    raise
        except MoeshardError:
            raise
        except OSError as e:
            if e.errno is not None:  # this machine's disk, not the network
                raise MoeshardError(f"{self.root}: cannot keep the fetched bytes: {e.strerror}") from None
            raise self._hub_error(e) from None
        except Exception as e:
            raise self._hub_error(e) from None
        finally:
            self._commit(fds, done)
            for fd in fds.values():
                os.close(fd)
            with self._count:
                self.transfer.seconds += time.monotonic() - t0

    def _hub_error(self, e: Exception) -> Exception:
        """A hub failure as one line (:func:`~moeshard.checkpoints.hub.hub_error`); others unchanged."""
        from moeshard.checkpoints.hub import hub_error, hub_errors

        return hub_error(self.repo_id, e) if isinstance(e, hub_errors()) else e

    def _commit(self, fds: dict[str, int], done: list[tuple[str, int, int]]) -> None:
        """Sync the shards' new bytes, then journal their ranges (never a range not on disk)."""
        if not done:
            return
        for f in {f for f, _, _ in done}:
            os.fdatasync(fds[f])
        with open(self.state / "journal.jsonl", "a") as j:
            j.write("".join(json.dumps(list(p)) + "\n" for p in done))
            j.flush()
            os.fsync(j.fileno())
        for f, a, b in done:
            self.spans.setdefault(f, Spans()).add(a, b)
        done.clear()

    def _get(self, fd: int, file: str, a: int, b: int, progress: Callable | None) -> None:
        """Bytes ``[a, b)`` of ``file`` into ``fd``: one request, and more for what short answers
        leave out; every answer's Content-Range and length checked."""
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_backoff

        url = hf_hub_url(self.repo_id, file, revision=self.commit)
        headers = build_hf_headers(token=self.token)
        pos, short = a, 0
        while pos < b:
            what = f"{self.repo_id}: {file}: bytes {pos}-{b - 1}"
            r = http_backoff("GET", url, headers={**headers, "Range": f"bytes={pos}-{b - 1}"},
                             timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT, base_wait_time=RETRY_WAIT,
                             max_wait_time=8 * RETRY_WAIT)
            hf_raise_for_status(r)
            _content_range(r, pos, self.files[file]["bytes"], what)
            data = r.content
            os.pwrite(fd, data, pos)
            pos += len(data)
            with self._count:
                self.transfer.fetched += len(data)
                self.transfer.requests += 1
            if progress is not None:
                progress(len(data), f"download {file}")
            short = short + 1 if pos < b else 0
            if short > MAX_SHORT:
                raise MoeshardError(f"{what}: {MAX_SHORT} answers in a row were shorter than asked; try again "
                                    "later (--resume keeps what arrived)")

    # -- what was read -------------------------------------------------------------------------------
    def _hashes(self, parts: list[Part]) -> dict[str, dict]:
        """Per shard: the sha256 of its header and of each of ``parts`` in it, read back from the
        cache (kept in ``hashes.jsonl``: a re-run hashes nothing twice)."""
        path = self.state / "hashes.jsonl"
        known = {}
        for line in path.read_text().splitlines() if path.is_file() else []:
            try:
                f, a, b, h = json.loads(line)
                known[(f, a, b)] = h
            except ValueError:
                continue
        spans = {(f, 0, self.header_bytes(f)) for f in self.spans}
        spans |= {(p.file, p.start, p.stop) for p in parts}
        todo = sorted(spans - known.keys())
        with ThreadPoolExecutor(self.max_workers) as pool:
            new = dict(zip(todo, pool.map(lambda s: sha256_range(self.root / s[0], s[1], s[2]), todo)))
        if new:
            with open(path, "a") as j:
                j.write("".join(json.dumps([*s, h]) + "\n" for s, h in new.items()))
        known.update(new)
        out: dict[str, dict] = {}
        for f in sorted(self.spans):  # every shard's header was read (the plan comes from them)
            out[f] = {"header_sha256": known[(f, 0, self.header_bytes(f))], "tensors": {}}
        for p in parts:
            out[p.file]["tensors"][p.key] = {"bytes": p.stop - p.start, "sha256": known[(p.file, p.start, p.stop)]}
        return out


def sha256_range(path: Path, a: int, b: int, chunk: int = 16 << 20) -> str:
    """SHA-256 of bytes ``[a, b)`` of ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(a)
        while a < b:
            data = f.read(min(chunk, b - a))
            if not data:
                raise MoeshardError(f"{path}: ended at byte {a}, expected {b}")
            h.update(data)
            a += len(data)
    return h.hexdigest()


def tensor_spans(path: Path) -> tuple[int, dict[str, tuple[int, int, list[int]]]]:
    """The header's size (8 + its length) of safetensors file ``path`` and, per tensor, its file
    offsets ``[start, stop)`` and shape, from the header alone (torch-free)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
        if n + 8 > size:
            raise MoeshardError(f"{path}: truncated safetensors header")
        header = json.loads(f.read(n))
    return 8 + n, {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1], v["shape"])
                   for k, v in header.items() if k != "__metadata__"}
