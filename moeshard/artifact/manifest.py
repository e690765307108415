"""The artifact manifest ``moeshard.json``, typed: the one place its schema lives.

The manifest is written last; a folder without it is not an artifact. It is input too: every
path in it must be relative, normalized and inside the artifact (:meth:`Manifest.read` refuses
the rest), and every file is opened through :func:`artifact_file`, which refuses symlinks that
lead outside it. Torch-free (``verify``, ``push`` and ``inspect`` import it).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from moeshard.errors import MoeshardError
from moeshard.files import load_json
from moeshard.paths import check_relative, inside

MANIFEST_NAME = "moeshard.json"
SCHEMA_VERSION = 2
#: Versions the reader takes. Version 1 artifacts (no ``--hidden-padding``, no layout fingerprint)
#: have GEMM2 with the padded hidden size ("vllm"): their ``kernel_args.valid_hidden_size`` only
#: informed and is dropped on reading, since that form is called without it.
READABLE_SCHEMA_VERSIONS = (1, 2)
#: Where a conversion notes, for this machine only, the absolute path of its source (never listed
#: in the manifest, never pushed): ``validate`` finds the source there.
LOCAL_NAME = ".moeshard-local.json"


@dataclass(frozen=True)
class FileRecord:
    """One file of the artifact: its path relative to the artifact, size and SHA-256 (hex)."""

    path: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Tool:
    name: str
    version: str
    flashinfer: str | None  # the flashinfer-python the layout came from


@dataclass(frozen=True)
class Source:
    """The source checkpoint as published: a Hub repo by id, revision and commit, a local folder
    by its name only; ``files``: each source file's size (and the hash the Hub names its blob by:
    ``sha256`` of an LFS file, ``git_sha1`` of another; of the whole file, recorded as the Hub
    gives it).

    ``ranged``: the shards were read by HTTP range (a Hub run of some ranks), not downloaded
    whole, so the Hub's whole-file hashes were not checked. What was checked instead is recorded
    per shard in ``files``: ``header_sha256`` (the header, parsed and checked against the file
    size: the plan comes from it) and ``tensors``, per tensor read (``name``, or ``name[a:b]``
    for expert rows a..b-1 of a fused tensor), its ``bytes`` (every answer's Content-Range and
    length checked against the header's offsets) and the ``sha256`` of the bytes read, to compare
    with any later read (``moeshard verify --source``)."""

    name: str | None
    repo_id: str | None
    revision: str | None
    commit: str | None
    files: dict
    ranged: bool = False

    def label(self) -> str:
        """``org/name at commit <sha>``, or the local folder's name (never a local path)."""
        if self.repo_id:
            return f"{self.repo_id} at commit {self.commit}"
        return f"a local checkpoint ({self.name or 'unnamed'})"


@dataclass(frozen=True)
class Layout:
    """The kernel layout; ``fingerprint``: per kernel tensor kind, the SHA-256 of the FlashInfer
    indices that define its layout for this artifact's shapes (:mod:`moeshard.layouts.fingerprint`;
    empty in version 1)."""

    name: str
    version: int
    epilogue_tile_m: int
    scale_layout: str
    scale_dtype: str
    sf_vec_size: int
    gemm1_rows: str
    fingerprint: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Padding:
    """Zero padding: H and the per-rank I to ``multiple``; GEMM2 (down projection) has
    ``gemm2_rows`` rows, ``hidden_size_padded`` for ``hidden_padding`` "vllm" (version 1 artifacts
    too), roundUp(hidden_size, 128) for "trimmed" (called with ``valid_hidden_size``)."""

    multiple: int
    hidden_size: int
    hidden_size_padded: int
    intermediate_size: int
    intermediate_size_padded: int  # per rank
    hidden_padding: str = "vllm"
    gemm2_rows: int | None = None  # None (version 1): hidden_size_padded

    def __post_init__(self) -> None:
        if self.gemm2_rows is None:
            object.__setattr__(self, "gemm2_rows", self.hidden_size_padded)


@dataclass(frozen=True)
class MoeLayer:
    """One MoE layer: its module prefix and the kernel's routing and size arguments."""

    layer: int
    prefix: str
    kernel_args: dict


@dataclass(frozen=True)
class Rank:
    """One rank: ``rank = ep_rank * tp_size + tp_rank``, its experts (global ids, in order), its
    slice of the intermediate dimension, and its files."""

    rank: int
    ep_rank: int
    tp_rank: int
    experts: tuple[int, ...]
    local_expert_offset: int | None  # None: round-robin placement
    local_num_experts: int
    intermediate_slice: tuple[int, int]
    intermediate_padding: int
    adds_gemm2_bias: bool
    folder: str
    files: tuple[FileRecord, ...]
    index: FileRecord


@dataclass(frozen=True)
class Common:
    """``common/``: every non-expert tensor of the source, unchanged."""

    folder: str
    files: tuple[FileRecord, ...]
    index: FileRecord


@dataclass(frozen=True)
class Manifest:
    """``moeshard.json``. ``ranks`` lists the ranks this artifact holds (a rank-only run holds
    some; ``rank_count`` says how many the sharding has); ``common`` is None without common/."""

    schema_version: int
    tool: Tool
    source: Source
    family: str
    quant_format: str
    layout: Layout
    padding: Padding
    num_experts: int
    ep_size: int
    tp_size: int
    placement: str
    placement_engines: str
    activation: dict
    router: dict
    moe_layers: tuple[MoeLayer, ...]
    ranks: tuple[Rank, ...]
    rank_count: int
    common: Common | None
    copied: tuple[FileRecord, ...]

    # -- reading and writing ---------------------------------------------------------------------
    def to_json(self) -> dict:
        """The JSON document (lists for tuples)."""
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, doc: dict, where: str = MANIFEST_NAME) -> Manifest:
        """The manifest of JSON ``doc``; a MoeshardError naming ``where`` when it does not fit the
        schema or a path in it leads outside the artifact."""
        version = doc.get("schema_version")
        if type(version) is not int or version not in READABLE_SCHEMA_VERSIONS:
            raise MoeshardError(f"{where}: schema_version: expected one of "
                                f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}, found {version!r}")
        if version == 1 and isinstance(doc.get("moe_layers"), list):
            doc = {**doc, "moe_layers": [_drop_valid_hidden_size(e) for e in doc["moe_layers"]]}
        src = doc.get("source")
        if isinstance(src, dict) and "path" in src and "name" not in src:  # written before names replaced paths
            src = {**{k: v for k, v in src.items() if k != "path"}, "name": Path(str(src["path"])).name}
            doc = {**doc, "source": src}
        m = _build(cls, doc, where)
        for r in m.ranks:
            check_relative(r.folder, where, "ranks[].folder", "artifact")
        if m.common:
            check_relative(m.common.folder, where, "common.folder", "artifact")
        for f in m.files():
            check_relative(f.path, where, "path", "artifact")
        return m

    @classmethod
    def read(cls, out: Path) -> Manifest:
        """The manifest of artifact folder ``out``; a MoeshardError when the folder does not exist,
        the manifest is missing or unreadable, or a path in it leads outside the artifact."""
        out = Path(out)
        if not out.exists():
            raise MoeshardError(f"{out}: does not exist (expected an artifact folder written by moeshard convert)")
        path = out / MANIFEST_NAME
        if not path.is_file():
            raise MoeshardError(f"{out}: not a moeshard artifact: {MANIFEST_NAME} is missing "
                                "(an interrupted or unfinished conversion leaves none)")
        return cls.from_json(load_json(path), str(path))

    # -- questions -------------------------------------------------------------------------------
    def files(self) -> list[FileRecord]:
        """Every file listed: rank files and indexes, common files and index, copied files."""
        common = [*self.common.files, self.common.index] if self.common else []
        return [f for r in self.ranks for f in (*r.files, r.index)] + common + list(self.copied)

    def rank(self, rank: int) -> Rank:
        r = next((r for r in self.ranks if r.rank == rank), None)
        if r is None:
            raise MoeshardError(f"no rank {rank} in this artifact (ranks: {[x.rank for x in self.ranks]})")
        return r

    def layer(self, layer: int) -> MoeLayer:
        return next(e for e in self.moe_layers if e.layer == layer)


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _drop_valid_hidden_size(layer):
    """A version 1 ``moe_layers`` entry without ``kernel_args.valid_hidden_size`` (see
    :data:`READABLE_SCHEMA_VERSIONS`); anything malformed is left for :func:`_build` to name."""
    if isinstance(layer, dict) and isinstance(layer.get("kernel_args"), dict):
        return {**layer, "kernel_args": {k: v for k, v in layer["kernel_args"].items() if k != "valid_hidden_size"}}
    return layer


def _build(cls, doc, where: str):
    """An instance of dataclass ``cls`` from JSON ``doc``, nested dataclasses and tuples included;
    a MoeshardError for a missing field (one with a default may be missing: older versions) or a
    value of the wrong type."""
    if not isinstance(doc, dict):
        raise MoeshardError(f"{where}: malformed manifest: expected an object for {cls.__name__}, "
                            f"found {type(doc).__name__}")
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in doc:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue  # a field added later: an older manifest has its default
            raise MoeshardError(f"{where}: malformed manifest: {cls.__name__}.{f.name} is missing")
        kw[f.name] = _value(hints[f.name], doc[f.name], where, f"{cls.__name__}.{f.name}")
    return cls(**kw)


def _value(tp, v, where: str, what: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, v, where)
    if origin is tuple:
        if not isinstance(v, list):
            raise MoeshardError(f"{where}: malformed manifest: {what}: expected a list, found {type(v).__name__}")
        items = args[:1] * len(v) if args[-1] is Ellipsis else args
        if len(items) != len(v):
            raise MoeshardError(f"{where}: malformed manifest: {what}: expected {len(items)} items, found {len(v)}")
        return tuple(_value(t, x, where, what) for t, x in zip(items, v))
    if tp in (int, str, bool, dict) and (not isinstance(v, tp) or (tp is int and isinstance(v, bool))):
        raise MoeshardError(f"{where}: malformed manifest: {what}: expected {tp.__name__}, found {v!r}")
    return v


def read_manifest(out: Path) -> dict:
    """The JSON of artifact ``out``'s manifest, checked against the schema (:meth:`Manifest.read`)."""
    return Manifest.read(out).to_json()


def artifact_file(out: Path, rel: str) -> Path:
    """``out / rel`` for a path of the manifest, refusing one that leads outside the artifact
    (``..``, absolute, or a symlink to elsewhere)."""
    return inside(out, rel, str(Path(out) / MANIFEST_NAME), "path", "artifact", allowed=out)


def is_artifact(path: Path) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()
