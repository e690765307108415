"""``moeshard convert``: resolve the source -> plan -> produce the files -> write the manifest.

Each step is a named function: :func:`resolve_source` (a folder, or a Hub repo id downloaded),
:func:`make_plan` (headers only; nothing is written before the plan holds), :func:`fetch_source`
(a Hub run of some ranks: the byte ranges this process reads), :func:`produce` (every output
file, shared out over the processes under torchrun) and :func:`build_manifest` (written last, by
process 0).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moeshard import __version__
from moeshard.artifact.manifest import (
    SCHEMA_VERSION,
    Common,
    FileRecord,
    Layout,
    Manifest,
    MoeLayer,
    Padding,
    Rank,
    Source,
    Tool,
    is_artifact,
)
from moeshard.artifact.output import OutputDir, check_free_space
from moeshard.checkpoints.families import (
    Adapter,
    check_sizes,
    detect,
    detect_config,
    expert_runs,
    needed_rows,
    needed_tensors,
)
from moeshard.checkpoints.hub import HubSource, needed_files, resolve
from moeshard.checkpoints.ranged import MAX_WORKERS, Part, RangeCache, Transfer
from moeshard.checkpoints.safetensors_io import INDEX_NAME, index_doc
from moeshard.checkpoints.source import Checkpoint
from moeshard.convert.distributed import Group
from moeshard.convert.plan import PLACEMENT_ENGINES, Options, OutFile, Plan, RankPlan, make_plan, rank_experts
from moeshard.convert.produce import Progress, write_common_file, write_rank_file
from moeshard.errors import Interrupted, MoeshardError
from moeshard.files import json_text, load_json
from moeshard.layouts.trtllm import LAYOUT_NAME, LAYOUT_VERSION, flashinfer_version
from moeshard.paths import hub_repo_root, overlaps


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    manifest: Manifest | None  # None in a torchrun process other than 0
    seconds: float
    bytes_read: int
    bytes_written: int  # by this run (reused files not counted)
    files_reused: int = 0
    bytes_reused: int = 0
    replaced: list[str] = field(default_factory=list)  # what --overwrite removed (top-level names)
    transfer: Transfer | None = None  # a ranged Hub source: what the processes fetched


def convert(source: Path | str, out: Path, *, ep_size: int = 1, tp_size: int = 1, placement: str = "contiguous",
            pad_multiple: int | None = None, hidden_padding: str = "vllm", max_shard_bytes: int | None = None,
            overwrite: bool = False, resume: bool = False, device: str = "cpu", progress: Progress | None = None,
            dry_run: bool = False, chunk_bytes: int | None = None, ranks: list[int] | None = None,
            common: bool = True, revision: str | None = None, cache_dir: Path | None = None,
            token: str | None = None, max_workers: int = MAX_WORKERS) -> ConvertResult | Plan:
    """Convert checkpoint ``source`` into the artifact folder ``out`` (DESIGN.md).

    Plans and validates every header first; nothing is written before the plan holds. Each file
    is written under a temporary name and renamed; the manifest is written last. ``resume``
    reuses the files an interrupted run finished (checked by size and sha256); the result is
    byte-identical to an uninterrupted run. With ``dry_run`` returns the :class:`Plan` and
    writes nothing. Under ``torchrun`` the output files are shared out over the processes
    (see :mod:`moeshard.convert.distributed`); the artifact is the same.

    ``source`` is a folder or a Hub repo id (``revision``, ``cache_dir``, ``token``,
    ``max_workers`` as huggingface_hub takes them). ``ranks`` converts only those ranks (a repo id
    then fetches only the byte ranges they read, as does each process under torchrun);
    ``common=False`` leaves out ``common/``. The other arguments are the :class:`Options` of the
    run.
    """
    defaults = Options()
    options = Options(ep_size=ep_size, tp_size=tp_size, placement=placement, pad_multiple=pad_multiple,
                      hidden_padding=hidden_padding, max_shard_bytes=max_shard_bytes or defaults.max_shard_bytes,
                      ranks=None if ranks is None else tuple(ranks), common=common, device=device,
                      chunk_bytes=chunk_bytes or defaults.chunk_bytes, overwrite=overwrite, resume=resume)
    check_options(options)
    group = Group.from_env()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the other cores hash and write; idle OpenMP workers would spin on them
    try:
        path, hub = resolve_source(str(source), options, group.world > 1, revision=revision, cache_dir=cache_dir,
                                   token=token, max_workers=max_workers)
        return run(group, path, hub, Path(out), options, progress if group.leader else None, dry_run)
    finally:
        torch.set_num_threads(threads)
        group.close()


def check_options(o: Options) -> None:
    """Refuse options that cannot work, before anything is read or written."""
    if o.overwrite and o.resume:
        raise MoeshardError("--overwrite and --resume exclude each other")
    if o.device != "cpu" and not o.device.startswith("cuda"):
        raise MoeshardError(f"--device {o.device}: expected cpu or cuda (cuda:N)")
    if o.device.startswith("cuda") and not torch.cuda.is_available():
        raise MoeshardError(f"--device {o.device}: no CUDA GPU found (torch {torch.__version__}); use --device cpu")


def check_output(out: Path, source: Path) -> None:
    """Refuse an output folder that is, contains or lies inside the source (for a Hub snapshot, its
    repo cache folder), once symlinks and ``..`` are resolved."""
    protected = hub_repo_root(source) or source
    if overlaps(out, protected):
        raise MoeshardError(f"{out}: overlaps the source {protected} (it is, contains or lies inside it once links "
                            "and '..' are resolved); choose an output folder outside the source")


def resolve_source(source: str, options: Options, several: bool = False, **hub) -> tuple[Path, HubSource | None]:
    """A local folder as it is, or a Hub repo id (``hub``: revision, cache_dir, token,
    max_workers): downloaded whole for a conversion of every rank by one process; otherwise (a
    rank-only run, or ``several`` processes) its configs and index, then a ranged cache with the
    shards' headers (:mod:`moeshard.checkpoints.ranged`; offline without one: only the shards
    its ranks read, whole)."""
    if options.ranks is None and not several:
        return resolve(source, **hub)

    def rank_shards(meta: Path) -> list[str]:
        config = load_json(meta / "config.json")
        qc = load_json(meta / "hf_quant_config.json") if (meta / "hf_quant_config.json").is_file() else None
        weight_map = load_json(meta / INDEX_NAME)["weight_map"]
        adapter = detect_config(config, qc, source)
        check_sizes(adapter, config, weight_map, f"{source}/config.json")
        e, o = adapter.num_experts(config), options
        experts = (None if o.ranks is None else
                   {x for r in o.ranks for x in rank_experts(e, o.ep_size, o.tp_size, o.placement, r)})
        return needed_files(weight_map, needed_tensors(adapter, config, weight_map, experts, o.common))

    return resolve(source, select=rank_shards, ranged=True, **hub)


def run(group: Group, source: Path, hub: HubSource | None, out: Path, options: Options, progress: Progress | None,
        dry_run: bool) -> ConvertResult | Plan:
    """Plan the conversion of the local ``source`` and (unless ``dry_run``) write the artifact."""
    check_output(out, source)
    if is_artifact(source):
        raise MoeshardError(f"{source}: is a moeshard artifact, not a checkpoint: convert its source "
                            "(moeshard inspect shows which)")
    if group.leader and not dry_run:
        OutputDir(out, {}, overwrite=options.overwrite, resume=options.resume).check()  # before anything is read
    t0 = time.perf_counter()
    with Checkpoint(source, partial=hub is not None and options.ranks is not None) as ckpt:
        adapter = detect(ckpt)
        plan = make_plan(ckpt, adapter.spec(ckpt), options)
        if dry_run:
            return plan
        tick = progress or (lambda n, what: None)
        if group.leader and not options.resume:
            check_free_space(out, plan.bytes_to_write)  # before anything is created
        transfer, read = None, None
        if hub is not None and hub.ranged is not None:
            transfer, read = fetch_source(group, plan, ckpt, adapter, hub.ranged, tick)
        if hasattr(tick, "total"):
            tick.total(plan.bytes_to_write)
        od = OutputDir(out, _fingerprint(plan, ckpt), overwrite=options.overwrite, resume=options.resume,
                       process=group.rank if group.world > 1 else None)
        try:
            manifest, results = produce(group, plan, ckpt, adapter, od, tick, source_record(ckpt, hub, read))
        except KeyboardInterrupt:
            n = len(od.done)
            raise Interrupted(f"{out}: interrupted; kept {n} finished file{'s' * (n != 1)} and no manifest (not an "
                              "artifact yet): run the same command with --resume to continue") from None
    reused_bytes = sum(x[4] for x in results)
    return ConvertResult(out, manifest, time.perf_counter() - t0, sum(x[2] for x in results),
                         plan.bytes_to_write - reused_bytes, sum(x[3] for x in results), reused_bytes, od.replaced,
                         transfer)


def _fingerprint(plan: Plan, ckpt: Checkpoint) -> dict:
    """What must be unchanged for --resume to reuse finished files."""
    o = plan.options
    args = {"ep_size": o.ep_size, "tp_size": o.tp_size, "placement": o.placement, "pad_multiple": plan.pad_multiple,
            "hidden_padding": o.hidden_padding, "max_shard_bytes": o.max_shard_bytes,
            "ranks": [r.rank for r in plan.chosen], "common": o.common}
    return {"tool": __version__, "source": str(ckpt.root.resolve()), "args": args,
            "source_files": {n: (ckpt.root / n).stat().st_size for n in ckpt.files + list(plan.copied)}}


def my_jobs(plan: Plan, group: Group) -> list[tuple[RankPlan | None, OutFile]]:
    """This process's output files, dealt out round-robin over the processes: ``(rank, file)`` of
    the chosen ranks' files, then ``(None, file)`` of common/'s."""
    jobs = [(r, f) for r in plan.chosen for f in r.files]
    return (jobs + ([(None, f) for f in plan.common] if plan.options.common else []))[group.rank::group.world]


def source_parts(plan: Plan, ckpt: Checkpoint, adapter: Adapter, jobs: list[tuple[RankPlan | None, OutFile]]
                 ) -> list[Part]:
    """The byte ranges of the source that these output files read (:func:`needed_rows`): what
    every process reads (routers, the activation scales of every expert and layer: the NVFP4
    maxima), each rank file's experts (whole per-expert tensors, rows of fused ones; a TP rank
    reads its experts whole and cuts them), each common file's tensors."""
    names, config, e = list(ckpt.tensors), ckpt.config, plan.spec.num_experts

    def parts(want: dict, own: bool) -> list[Part]:
        out = []
        for name, experts in want.items():
            t = ckpt.tensors[name]
            if experts is None or not t.shape or t.shape[0] != e:
                out.append(Part(t.file, t.offset, t.offset + t.nbytes, name, None, own))
            else:
                row = t.nbytes // e
                out += [Part(t.file, t.offset + a * row, t.offset + b * row, name, (a, b), own)
                        for a, b in expert_runs(sorted(experts))]
        return out

    out = parts(needed_rows(adapter, config, names, set(), False), False)
    seen = {(p.file, p.start, p.stop) for p in out}
    for r, f in jobs:
        want = ({n: None for n in f.sources} if r is None else
                needed_rows(adapter, config, names, set(r.experts), False, f.layers))
        for p in parts(want, r is not None):
            if (p.file, p.start, p.stop) not in seen:
                seen.add((p.file, p.start, p.stop))
                out.append(p)
    return out


def fetch_source(group: Group, plan: Plan, ckpt: Checkpoint, adapter: Adapter, cache: RangeCache, tick: Progress
                 ) -> tuple[Transfer, dict]:
    """A ranged Hub source: fetch into ``cache`` the byte ranges this process reads
    (:func:`source_parts` of :func:`my_jobs`); every process's :class:`Transfer` summed, and what
    they read (per shard, :meth:`RangeCache.fetch`) merged."""
    error, got = None, None
    try:
        parts = source_parts(plan, ckpt, adapter, my_jobs(plan, group))
        check_free_space(cache.root, sum(b - a for rs in cache.missing(parts).values() for a, b in rs))
        got = (cache.fetch(parts, tick), cache.transfer)
    except Exception as e:
        if group.world == 1:
            raise
        error = f"process {group.rank}: {e}"
    results = group.gather((error, got))
    errors = [err for err, _ in results if err]
    if errors:
        raise MoeshardError(errors[0])
    read: dict[str, dict] = {}
    for _, (files, _) in results:
        for name, rec in files.items():
            read.setdefault(name, {"header_sha256": rec["header_sha256"], "tensors": {}})["tensors"].update(rec["tensors"])
    return sum((t for _, (_, t) in results), Transfer()), read


def produce(group: Group, plan: Plan, ckpt: Checkpoint, adapter, od: OutputDir, tick: Progress,
            source: Source) -> tuple[Manifest | None, list]:
    """Write this process's share of the files into ``od``, then (process 0) the indexes, the copied
    files and the manifest (of ``source``); every process's ``(error, records, bytes_read,
    files_reused, bytes_reused)``."""
    spec, out, o = plan.spec, od.out, plan.options
    mine = my_jobs(plan, group)
    with ExitStack() as stack:
        if group.leader:
            stack.enter_context(od)
        group.barrier()  # the folder is locked and prepared
        if not group.leader:
            stack.enter_context(od)
        error, records, reused = None, {}, {}
        try:
            reused = {f.path: rec for _, f in mine if (rec := od.reusable(f.path))}
            if o.resume and group.leader:
                check_free_space(out, plan.total_bytes - sum(rec["bytes"] for rec in reused.values()))
            # NVFP4 (a13, a2) per layer: read once, the same on every rank
            scales = {layer: adapter.input_scales(ckpt, spec, layer) for layer in spec.moe_layers}
            for r, f in mine:
                if f.path in reused:
                    tick(f.nbytes, f"{f.path} (reused)")
                elif r is not None:
                    od.write(f.path, lambda tmp, r=r, f=f: write_rank_file(plan, ckpt, adapter, r, f, tmp, scales,
                                                                           tick))
                else:
                    od.write(f.path, lambda tmp, f=f: write_common_file(ckpt, f, tmp, o.chunk_bytes, tick))
            records = od.records()
        except Exception as e:
            if group.world == 1:
                raise
            error = f"process {group.rank}: {e}"
        results = group.gather((error, records, ckpt.bytes_read, len(reused),
                                sum(rec["bytes"] for rec in reused.values())))
        errors = [err for err, *_ in results if err]
        if errors:
            raise MoeshardError(errors[0])
        files = {k: v for _, recs, *_ in results for k, v in recs.items()}
        manifest = None
        if group.leader:
            for r in plan.chosen:
                names = {t.name: Path(f.path).name for f in r.files for layer in f.layers
                         for t in plan.layer_tensors(layer, len(r.experts))}
                od.write_text(f"{r.folder}/{INDEX_NAME}", json_text(index_doc(names, sum(f.nbytes for f in r.files))))
            if o.common:
                names = {n: Path(f.path).name for f in plan.common for n in f.sources}
                od.write_text(f"common/{INDEX_NAME}",
                              json_text(index_doc(names, sum(f.nbytes for f in plan.common))))
            for name in plan.copied:
                od.copy(name, ckpt.file(name))
            files.update(od.records())
            manifest = build_manifest(plan, files, source)
            od.finish(manifest, {"source": str(ckpt.root.resolve())})
        group.barrier()  # followers return once the manifest is written
    return manifest, results


def source_record(ckpt: Checkpoint, hub: HubSource | None, read: dict | None = None) -> Source:
    """What the manifest says of the source: a Hub repo by id and commit, a local folder by its
    name only (the manifest is published by push); this machine's path goes to the local note.
    ``read``: a ranged source's record of each shard (:meth:`RangeCache.fetch`), added to its file."""
    if hub is not None:
        files = hub.files if read is None else {n: {**h, **read.get(n, {})} for n, h in hub.files.items()}
        return Source(hub.repo_id, hub.repo_id, hub.revision, hub.commit, files, ranged=read is not None)
    return Source(ckpt.root.name, None, None, None,
                  {n: {"bytes": (ckpt.root / n).stat().st_size} for n in ckpt.files})


def kernel_args(plan: Plan) -> dict:
    """The kernel's routing and size arguments of a MoE layer (the same for every layer);
    ``valid_hidden_size`` only where the kernel must get it ("trimmed" hidden padding)."""
    spec = plan.spec
    trimmed = {"valid_hidden_size": spec.hidden_size} if plan.options.hidden_padding == "trimmed" else {}
    return {**spec.routing, "num_experts": spec.num_experts, "hidden_size": plan.hidden_size_padded,
            "intermediate_size": plan.intermediate_size_padded, **trimmed,
            "activation_type": spec.activation["activation_type"]}


def build_manifest(plan: Plan, files: dict[str, dict], source: Source) -> Manifest:
    """The manifest of the chosen ranks (and common/ when written); ``files``: path -> bytes, sha256."""
    spec = plan.spec
    rec = lambda path: FileRecord(path, files[path]["bytes"], files[path]["sha256"])  # noqa: E731
    ranks = tuple(Rank(r.rank, r.ep_rank, r.tp_rank, r.experts, r.experts[0] if r.contiguous else None,
                       len(r.experts), (r.i_start, r.i_stop), plan.intermediate_size_padded - (r.i_stop - r.i_start),
                       spec.has_bias and r.tp_rank == 0, r.folder, tuple(rec(f.path) for f in r.files),
                       rec(f"{r.folder}/{INDEX_NAME}")) for r in plan.chosen)
    common = (Common("common", tuple(rec(f.path) for f in plan.common), rec(f"common/{INDEX_NAME}"))
              if plan.options.common else None)
    return Manifest(
        schema_version=SCHEMA_VERSION,
        tool=Tool("moeshard", __version__, flashinfer_version()),
        source=source,
        family=spec.family.value,
        quant_format=spec.quant_format.value,
        layout=Layout(LAYOUT_NAME, LAYOUT_VERSION, plan.epilogue_tile_m, "128x4", "float8_e4m3fn",
                      spec.quant_format.sf_vec_size, "gated-interleaved [up, gate]", plan.fingerprint),
        padding=Padding(plan.pad_multiple, spec.hidden_size, plan.hidden_size_padded, spec.intermediate_size,
                        plan.intermediate_size_padded, plan.options.hidden_padding, plan.gemm2_rows),
        num_experts=spec.num_experts,
        ep_size=plan.options.ep_size,
        tp_size=plan.options.tp_size,
        placement=plan.options.placement,
        placement_engines=PLACEMENT_ENGINES[plan.options.placement],
        activation=spec.activation,
        router=spec.router,
        moe_layers=tuple(MoeLayer(layer, spec.prefix(layer), kernel_args(plan)) for layer in spec.moe_layers),
        ranks=ranks,
        rank_count=len(plan.ranks),
        common=common,
        copied=tuple(rec(name) for name in plan.copied),
    )


__all__ = ["ConvertResult", "Options", "convert"]
