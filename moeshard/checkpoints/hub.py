"""Hugging Face Hub access in one place: resolve a repo id to a local snapshot (only the files a
conversion needs) or, for a run of some ranks, to a cache of the byte ranges it reads
(:mod:`moeshard.checkpoints.ranged`); record what was used; one-line hub errors.

Environment as huggingface_hub reads it: ``HF_HOME`` / ``HF_HUB_CACHE`` (where), ``HF_TOKEN``
(who), ``HF_ENDPOINT`` (which Hub), ``HF_HUB_OFFLINE=1`` (the cache only). Progress of whole-file
downloads is the hub's own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from moeshard.checkpoints.ranged import MAX_WORKERS, RangeCache
from moeshard.errors import MoeshardError

#: Files a conversion reads or copies: configs, quant config, index, tokenizer and generation
#: files (top level only: openai/gpt-oss's original/ and metal/ are left out).
META_PATTERNS = ("config.json", "hf_quant_config.json", "generation_config.json", "model.safetensors.index.json",
                 "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "tokenizer.model")
#: The shards (top level: "model-*" does not match "original/model-*").
SHARD_PATTERNS = ("model-*.safetensors", "model.safetensors")
ALLOW_PATTERNS = META_PATTERNS + SHARD_PATTERNS


@dataclass
class HubSource:
    """Where a repo id resolved to: the local snapshot folder (or ranged cache, ``ranged``), the
    commit, and each file's hash."""

    repo_id: str
    revision: str | None
    commit: str
    path: Path
    files: dict[str, dict] = field(default_factory=dict)  # name -> {"bytes", "sha256" (LFS) or "git_sha1"}
    ranged: RangeCache | None = None

    def manifest_source(self) -> dict:
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit}


def looks_like_repo_id(source: str) -> bool:
    """``org/name`` that is not a local path."""
    return not Path(source).exists() and source.count("/") == 1 and not source.startswith((".", "/", "~"))


def hub_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a hub call raises for a reason the user can fix (network, auth, not found)."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
    )

    errors: tuple = (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, IncompleteSnapshotError, OSError,
                     ValueError)
    try:  # huggingface_hub 2.x speaks HTTP through httpx2 (1.x: httpx); a dead network raises its errors
        import httpx2

        errors += (httpx2.HTTPError, httpx2.InvalidURL)
    except ImportError:
        pass
    return errors


def hub_error(repo_id: str, e: BaseException, local_hint: bool = False) -> MoeshardError:
    """One line for a hub failure; ``local_hint``: ``repo_id`` could also have been a mistyped
    relative path, so say that no such folder exists either."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    first = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, GatedRepoError):
        return MoeshardError(f"{repo_id}: gated repository: accept its license on https://huggingface.co/{repo_id}, "
                             "then authenticate with `hf auth login` or HF_TOKEN=<token>")
    if isinstance(e, RevisionNotFoundError):
        return MoeshardError(f"{repo_id}: revision not found: {first}")
    prefix = f"{repo_id}: no folder {repo_id} here, and " if local_hint else f"{repo_id}: "
    if isinstance(e, RepositoryNotFoundError):
        return MoeshardError(f"{prefix}no Hub repository of that name (or it is private: authenticate with "
                             "`hf auth login` or HF_TOKEN)")
    if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return MoeshardError(f"{prefix}not in the local Hub cache and the Hub cannot be reached "
                             f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): {first}")
    return MoeshardError(f"{prefix}the Hub request failed ({type(e).__name__}: {first})" if local_hint else
                         f"{repo_id}: the Hub request failed ({type(e).__name__}: {first}); check the network, "
                         "HF_ENDPOINT and HF_TOKEN")


def download(repo_id: str, patterns: list[str], revision: str | None = None, cache_dir: Path | None = None,
             token: str | None = None) -> Path:
    """``snapshot_download`` of the files matching ``patterns`` from one revision."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns), cache_dir=cache_dir,
                                      token=token))
    except hub_errors() as e:
        raise hub_error(repo_id, e, local_hint=True) from None


def file_hashes(snapshot: Path) -> dict[str, dict]:
    """Each file of a snapshot: size and the hash the Hub keys its blob by (LFS: sha256)."""
    out = {}
    for p in sorted(snapshot.rglob("*")):
        if p.is_file():
            blob = Path(os.path.realpath(p)).name
            key = "sha256" if len(blob) == 64 else "git_sha1"
            out[str(p.relative_to(snapshot))] = {"bytes": p.stat().st_size, key: blob}
    return out


def needed_files(weight_map: dict[str, str], names: set[str]) -> list[str]:
    """The shards (per the index) holding these tensors."""
    return sorted({weight_map[n] for n in names})


def resolve(source: str, *, revision: str | None = None, cache_dir: Path | None = None, token: str | None = None,
            select=None, ranged: bool = False, max_workers: int = MAX_WORKERS) -> tuple[Path, HubSource | None]:
    """A local folder as it is, or a repo id downloaded (everything a conversion needs).

    A run of some ranks gets the configs and the index first, then, from the same commit:
    with ``ranged``, a :class:`RangeCache` holding every shard's header (the run fetches the
    ranges it reads later); without it, or offline with no ranged cache of that commit, only the
    shards ``select(folder) -> list[str]`` chooses from the configs and the index.
    """
    if not looks_like_repo_id(source):
        return Path(source), None
    if select is None and not ranged:
        path = download(source, list(ALLOW_PATTERNS), revision, cache_dir, token)
        return path, HubSource(source, revision, path.name, path, file_hashes(path))
    meta = download(source, list(META_PATTERNS), revision, cache_dir, token)
    commit = meta.name  # every file comes from the commit the metadata came from
    repo_cache = meta.parent.parent
    if ranged and (not _offline() or (repo_cache / RangeCache.folder(commit)).is_dir()):
        try:
            cache = RangeCache.open(source, commit, meta, repo_cache, token, max_workers)
        except hub_errors() as e:
            raise hub_error(source, e) from None
        return cache.root, HubSource(source, revision, commit, cache.root,
                                     {n: h for n, h in cache.files.items() if (cache.root / n).is_file()}, cache)
    shards = select(meta) if (meta / "model.safetensors.index.json").is_file() else ["model.safetensors"]
    path = download(source, list(META_PATTERNS) + shards, commit, cache_dir, token)
    return path, HubSource(source, revision, commit, path, file_hashes(path))


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)
