"""convert: plan -> read -> canonical -> pad -> layout -> write -> manifest."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moeshard import __version__
from moeshard.convert.distributed import Group
from moeshard.convert.families import QuantFormat, check_sizes, detect, detect_config, read_experts
from moeshard.convert.hub import HubSource, needed_files, needed_tensors, resolve
from moeshard.convert.io import DTYPES, INDEX_NAME, index_doc, pread_into
from moeshard.convert.manifest import SCHEMA_VERSION
from moeshard.convert.output import OutputDir, check_free_space
from moeshard.convert.plan import PLACEMENT_ENGINES, OutFile, Plan, RankPlan, make_plan, rank_experts
from moeshard.convert.source import Checkpoint
from moeshard.convert.writer import SequentialWriter
from moeshard.errors import Interrupted, MoeshardError
from moeshard.files import json_text, load_json
from moeshard.kernel import flashinfer_version
from moeshard.layouts.canonical import CanonicalExperts, concat_experts, slice_intermediate
from moeshard.layouts.trtllm import (
    KERNEL_FIELDS,
    LAYOUT_NAME,
    LAYOUT_VERSION,
    nvfp4_scalars,
    swiglu_oai_scalars,
    trtllm_tensor,
)
from moeshard.paths import hub_repo_root, overlaps

#: progress(bytes_done_now, what): called as bytes are written; progress.total(n) once planned.
Progress = Callable[[int, str], None]


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    manifest: dict
    seconds: float
    bytes_read: int
    bytes_written: int  # by this run (reused files not counted)
    files_reused: int = 0
    bytes_reused: int = 0
    replaced: list[str] = field(default_factory=list)  # what --overwrite removed (top-level names)


def expert_runs(experts) -> list[tuple[int, int]]:
    """Maximal runs of consecutive expert ids, in order: ``[(start, stop), ...]``."""
    runs: list[list[int]] = []
    for x in experts:
        if runs and runs[-1][1] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, x + 1])
    return [(a, b) for a, b in runs]


def read_rank_experts(adapter, ckpt: Checkpoint, spec, layer: int, experts: tuple[int, ...] | list[int],
                      i_start: int, i_stop: int, tp_rank: int) -> CanonicalExperts:
    """One rank's canonical experts of one layer, unpadded: its experts (one read per run of
    consecutive experts), its TP slice of the intermediate dimension, and the down-projection
    bias only on TP rank 0 (zeros elsewhere, as vLLM loads it: the row-parallel outputs are
    summed). The reference path (validate); convert reads the same in place (:func:`_rank_field`)."""
    c = concat_experts([read_experts(adapter, ckpt, spec, layer, a, b) for a, b in expert_runs(experts)])
    if (i_start, i_stop) != (0, spec.intermediate_size):
        c = slice_intermediate(c, i_start, i_stop)
    if tp_rank > 0 and c.w2_bias is not None:
        c = c.replace(w2_bias=torch.zeros_like(c.w2_bias))
    return c


def _rank_field(adapter, ckpt: Checkpoint, spec, layer: int, field: str, start: int, stop: int,
                rank: RankPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:meth:`Adapter.read_raw` with the rank's TP slice applied in place: ``[up[s:t] ; gate[s:t]]``
    rows of the GEMM1 fields (a row map), columns ``[s, t)`` of the GEMM2 ones (a view), as
    :func:`slice_intermediate` cuts them; the GEMM2 bias is zero on TP ranks after the first."""
    src, rows = adapter.read_raw(ckpt, spec, layer, field, start, stop)
    i, sf, s, t = spec.intermediate_size, spec.quant_format.sf_vec_size, rank.i_start, rank.i_stop
    if (s, t) != (0, i):
        if field.startswith("w13"):
            keep = torch.cat((torch.arange(s, t), torch.arange(i + s, i + t)))
            rows = keep if rows is None else rows[keep]
        elif field in ("w2", "w2_scale"):
            per = 2 if field == "w2" else sf  # elements per stored column
            src = src[:, :, s // per:t // per]
    if field == "w2_bias" and rank.tp_rank > 0:
        src = torch.zeros_like(src)
    return src, rows


def kernel_scalars(spec, n: int, w13_scale_2: torch.Tensor | None = None, w2_scale_2: torch.Tensor | None = None,
                   input_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The kernel scalars of ``n`` experts: GPT-OSS's SwiGLU constants, or NVFP4's output scales
    from their ``weight_scale_2`` (``[n]``) and the layer's ``(a13, a2)``. Float32 ``[n]`` each
    (``hidden_states_scale_global`` ``[]``)."""
    out: dict[str, torch.Tensor] = {}
    if spec.activation["type"] == "swiglu_oai":
        a = spec.activation
        out.update(swiglu_oai_scalars(n, a["limit"], a["alpha"], a["beta"]))
    if spec.quant_format is QuantFormat.NVFP4:
        out.update(nvfp4_scalars(w13_scale_2, w2_scale_2, *input_scales))
    return out


def layer_scalars(plan: Plan, ckpt: Checkpoint, adapter, layer: int, rank: RankPlan,
                  input_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """:func:`kernel_scalars` of one rank's experts of one layer, read from the source
    (``input_scales`` too when None)."""
    spec = plan.spec
    if spec.quant_format is not QuantFormat.NVFP4:
        return kernel_scalars(spec, len(rank.experts))
    parts = [adapter.read_scalars(ckpt, spec, layer, a, b) for a, b in expert_runs(rank.experts)]
    return kernel_scalars(spec, len(rank.experts), torch.cat([p["w13_scale_2"] for p in parts]),
                          torch.cat([p["w2_scale_2"] for p in parts]),
                          input_scales if input_scales is not None else adapter.input_scales(ckpt, spec, layer))


def _kernel_args(plan: Plan, layer: int) -> dict:
    spec = plan.spec
    return {**spec.routing, "num_experts": spec.num_experts, "hidden_size": plan.hidden_size_padded,
            "intermediate_size": plan.intermediate_size_padded, "valid_hidden_size": spec.hidden_size,
            "activation_type": spec.activation["activation_type"]}


def build_manifest(plan: Plan, files: dict[str, dict], source: dict, ranks: list[RankPlan] | None = None,
                   common: bool = True) -> dict:
    """The manifest: ``ranks`` (default all) and ``common`` say what this artifact holds; a
    rank-only run holds some ranks (``rank_count`` says how many the sharding has)."""
    spec = plan.spec
    ranks = list(plan.ranks) if ranks is None else ranks
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "moeshard", "version": __version__, "flashinfer": flashinfer_version()},
        "source": source,
        "family": spec.family.value,
        "quant_format": spec.quant_format.value,
        "layout": {"name": LAYOUT_NAME, "version": LAYOUT_VERSION, "epilogue_tile_m": plan.epilogue_tile_m,
                   "scale_layout": "128x4", "scale_dtype": "float8_e4m3fn",
                   "sf_vec_size": spec.quant_format.sf_vec_size, "gemm1_rows": "gated-interleaved [up, gate]"},
        "padding": {"multiple": plan.pad_multiple, "hidden_size": spec.hidden_size,
                    "hidden_size_padded": plan.hidden_size_padded, "intermediate_size": spec.intermediate_size,
                    "intermediate_size_padded": plan.intermediate_size_padded},
        "num_experts": spec.num_experts,
        "ep_size": plan.ep_size,
        "tp_size": plan.tp_size,
        "placement": plan.placement,
        "placement_engines": PLACEMENT_ENGINES[plan.placement],
        "activation": spec.activation,
        "router": spec.router,
        "moe_layers": [{"layer": layer, "prefix": spec.prefix(layer), "kernel_args": _kernel_args(plan, layer)}
                       for layer in spec.moe_layers],
        "ranks": [{"rank": r.rank, "ep_rank": r.ep_rank, "tp_rank": r.tp_rank, "experts": list(r.experts),
                   "local_expert_offset": r.experts[0] if r.contiguous else None,
                   "local_num_experts": len(r.experts),
                   "intermediate_slice": [r.i_start, r.i_stop],
                   "intermediate_padding": plan.intermediate_size_padded - (r.i_stop - r.i_start),
                   "adds_gemm2_bias": (spec.quant_format is QuantFormat.MXFP4 and r.tp_rank == 0),
                   "folder": r.folder, "files": [{"path": f.path, **files[f.path]} for f in r.files],
                   "index": {"path": f"{r.folder}/{INDEX_NAME}", **files[f"{r.folder}/{INDEX_NAME}"]}}
                  for r in ranks],
        "rank_count": len(plan.ranks),
        "common": ({"folder": "common", "files": [{"path": f.path, **files[f.path]} for f in plan.common],
                    "index": {"path": f"common/{INDEX_NAME}", **files[f"common/{INDEX_NAME}"]}} if common else None),
        "copied": [{"path": name, **files[name]} for name in plan.copied],
    }


#: Output bytes transformed per step: bounds memory whatever the layer or model size.
CHUNK_BYTES = 64 << 20
#: How far ahead of the transform the source is read (page cache, which the kernel can reclaim):
#: per-expert checkpoints scatter a chunk's tensors over the file.
PREFETCH_BYTES = 512 << 20


def write_rank_file(plan: Plan, ckpt: Checkpoint, adapter, rank: RankPlan, f: OutFile, path: Path,
                    device: str = "cpu", scales: dict | None = None, chunk_bytes: int = CHUNK_BYTES,
                    tick: Progress | None = None) -> Future:
    """Write one rank file front to back; a future of its SHA-256 (:meth:`SequentialWriter.close`).

    Each kernel tensor is produced chunk of experts by chunk of experts straight into the
    writer's staging buffer (:func:`trtllm_tensor`: one gather from the source's memory map,
    padding and permutations composed) while earlier buffers are written and hashed, and the
    disk reads the next chunk ahead (``posix_fadvise``). ``device`` other than "cpu" runs the
    gathers there.
    """
    spec, n = plan.spec, len(rank.experts)
    tensors = {t.name: (layer, t) for layer in f.layers for t in plan.layer_tensors(layer, n)}
    per_expert = {name: t.nbytes // n for name, (_, t) in tensors.items() if t.shape}
    w = SequentialWriter(path, [(t.name, t.dtype, t.shape) for _, t in tensors.values()],
                         max_take=max([chunk_bytes, *per_expert.values()]))
    scalars: dict[int, dict[str, torch.Tensor]] = {}
    sizes = (plan.hidden_size_padded, plan.intermediate_size_padded, spec.quant_format.sf_vec_size,
             plan.epilogue_tile_m)
    try:
        for name in w.order:
            layer, t = tensors[name]
            prefix = spec.prefix(layer)
            kind = name[len(prefix) + 1:]
            if kind not in KERNEL_FIELDS:
                if layer not in scalars:
                    scalars[layer] = layer_scalars(plan, ckpt, adapter, layer, rank, (scales or {}).get(layer))
                w.put(name, scalars[layer][kind])
                continue
            field, per = KERNEL_FIELDS[kind], per_expert[name]
            step = max(1, chunk_bytes // per)
            chunks = [rank.experts[k:k + step] for k in range(0, n, step)]
            leaves = tuple("." + leaf for leaf in adapter.sources.get(field, ()))
            sources = [x for x in spec.expert_tensors if x.startswith(prefix + ".") and x.endswith(leaves)]
            ahead = max(1, PREFETCH_BYTES // (per * len(chunks[0])))
            for c in chunks[:ahead]:
                prefetch_experts(ckpt, prefix + ".", sources, c)
            for j, chunk in enumerate(chunks):
                if j + ahead < len(chunks):  # the disk reads chunks ahead while this one is transformed
                    prefetch_experts(ckpt, prefix + ".", sources, chunks[j + ahead])
                dst = w.take(name, per * len(chunk)).view(DTYPES[t.dtype]).view(len(chunk), *t.shape[1:])
                e = 0
                for a, b in expert_runs(chunk):
                    src, rows = _rank_field(adapter, ckpt, spec, layer, field, a, b, rank)
                    if device == "cpu":
                        trtllm_tensor(kind, src, rows, *sizes, out=dst[e:e + b - a])
                    else:
                        dst[e:e + b - a].copy_(trtllm_tensor(kind, src.to(device), rows, *sizes).cpu())
                    e += b - a
                if tick:
                    tick(per * len(chunk), f"{rank.folder} layer {layer}")
        return w.close()
    except BaseException:
        w.abort()
        raise


def prefetch_experts(ckpt: Checkpoint, prefix: str, names: list[str], experts: tuple[int, ...]) -> None:
    """Start reading the source bytes of these experts of one layer (``names``: source tensors
    under ``prefix``; see :meth:`Checkpoint.prefetch`): their rows of fused tensors, or their own
    tensors (per-expert checkpoints)."""
    lo, hi, wanted = min(experts), max(experts) + 1, {str(e) for e in experts}
    for name in names:
        head = name[len(prefix):].split(".")[0]
        if not head.isdigit():
            ckpt.prefetch(name, lo, hi)
        elif head in wanted:
            ckpt.prefetch(name)


def write_common_file(ckpt: Checkpoint, f: OutFile, path: Path, chunk_bytes: int = CHUNK_BYTES,
                      tick: Progress | None = None) -> Future:
    """Copy non-expert tensors unchanged, read (``preadv``) straight into the writer's staging
    buffer while earlier ones are written and hashed; a future of the file's SHA-256."""
    w = SequentialWriter(path, [(n, ckpt.tensors[n].dtype, ckpt.tensors[n].shape) for n in f.sources],
                         max_take=chunk_bytes)
    fds: dict[str, int] = {}
    try:
        for n in w.order:
            info = ckpt.tensors[n]
            if info.file not in fds:
                fds[info.file] = os.open(ckpt.root / info.file, os.O_RDONLY)
            fd, pos, left = fds[info.file], info.offset, info.nbytes
            while left:
                k = min(left, chunk_bytes)
                if left > k and hasattr(os, "posix_fadvise"):  # the disk reads the next piece meanwhile
                    os.posix_fadvise(fd, pos + k, min(left - k, chunk_bytes), os.POSIX_FADV_WILLNEED)
                pread_into(fd, memoryview(w.take(n, k).numpy()), pos, f"{ckpt.root / info.file} (tensor {n})")
                pos, left = pos + k, left - k
                if tick:
                    tick(k, f.path)
        return w.close()
    except BaseException:
        w.abort()
        raise
    finally:
        for fd in fds.values():
            os.close(fd)


def _fingerprint(plan: Plan, ckpt: Checkpoint, args: dict) -> dict:
    """What must be unchanged for --resume to reuse finished files."""
    return {"tool": __version__, "source": str(ckpt.root.resolve()), "args": args,
            "source_files": {n: (ckpt.root / n).stat().st_size for n in ckpt.files + list(plan.copied)}}


def convert(source: Path | str, out: Path, *, ep_size: int = 1, tp_size: int = 1, placement: str = "contiguous",
            pad_multiple: int | None = None, max_shard_bytes: int | None = None, overwrite: bool = False,
            resume: bool = False, device: str = "cpu", progress: Progress | None = None,
            dry_run: bool = False, chunk_bytes: int = CHUNK_BYTES, ranks: list[int] | None = None,
            common: bool = True, revision: str | None = None, cache_dir: Path | None = None,
            token: str | None = None) -> ConvertResult | Plan:
    """Convert checkpoint folder ``source`` into the artifact folder ``out`` (DESIGN.md).

    Plans and validates every header first; nothing is written before the plan holds. Each file
    is written under a temporary name and renamed; the manifest is written last. ``resume``
    reuses the files an interrupted run finished (checked by size and sha256); the result is
    byte-identical to an uninterrupted run. With ``dry_run`` returns the :class:`Plan` and
    writes nothing. Under ``torchrun`` the output files are shared out over the processes
    (see :mod:`moeshard.convert.distributed`); the artifact is the same.

    ``source`` is a folder or a Hub repo id (``revision``, ``cache_dir``, ``token`` as
    huggingface_hub takes them). ``ranks`` converts only those ranks (a repo id then fetches only
    the shards they need); ``common=False`` leaves out ``common/``.
    """
    check_device(device)
    group = Group.from_env()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the other cores hash and write; idle OpenMP workers would spin on them
    try:
        select = None
        if ranks is not None:
            def select(meta: Path) -> list[str]:
                config = load_json(meta / "config.json")
                qc = load_json(meta / "hf_quant_config.json") if (meta / "hf_quant_config.json").is_file() else None
                weight_map = load_json(meta / INDEX_NAME)["weight_map"]
                adapter = detect_config(config, qc, f"{source}/config.json")
                check_sizes(adapter, config, weight_map, f"{source}/config.json")
                e = adapter.num_experts(config)
                experts = {x for r in ranks for x in rank_experts(e, ep_size, tp_size, placement, r)}
                return needed_files(weight_map, needed_tensors(weight_map, adapter, config, experts, common))
        path, hub = resolve(str(source), revision=revision, cache_dir=cache_dir, token=token, select=select)
        return _convert(group, path, hub, Path(out), ep_size=ep_size, tp_size=tp_size, placement=placement,
                        pad_multiple=pad_multiple, max_shard_bytes=max_shard_bytes, overwrite=overwrite,
                        resume=resume, device=device, progress=progress if group.leader else None,
                        dry_run=dry_run, chunk_bytes=chunk_bytes, ranks=ranks, common=common)
    finally:
        torch.set_num_threads(threads)
        group.close()


def check_device(device: str) -> None:
    """Refuse a device the conversion cannot run on, before anything is read or written."""
    if device != "cpu" and not device.startswith("cuda"):
        raise MoeshardError(f"--device {device}: expected cpu or cuda (cuda:N)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MoeshardError(f"--device {device}: no CUDA GPU found (torch {torch.__version__}); use --device cpu")


def check_output(out: Path, source: Path) -> None:
    """Refuse an output folder that is, contains or lies inside the source (for a Hub snapshot, its
    repo cache folder), once symlinks and ``..`` are resolved."""
    protected = hub_repo_root(source) or source
    if overlaps(out, protected):
        raise MoeshardError(f"{out}: overlaps the source {protected} (it is, contains or lies inside it once links "
                            "and '..' are resolved); choose an output folder outside the source")


def _convert(group: Group, source: Path, hub: HubSource | None, out: Path, *, ep_size, tp_size, placement,
             pad_multiple, max_shard_bytes, overwrite, resume, device, progress, dry_run, chunk_bytes, ranks,
             common) -> ConvertResult | Plan:
    from moeshard.convert.plan import DEFAULT_MAX_SHARD_BYTES

    if overwrite and resume:
        raise MoeshardError("--overwrite and --resume exclude each other")
    check_output(out, source)
    if group.leader and not dry_run:
        OutputDir(out, {}, overwrite=overwrite, resume=resume).check()  # before anything is read or written
    t0 = time.perf_counter()
    with Checkpoint(source, partial=hub is not None and ranks is not None) as ckpt:
        adapter = detect(ckpt)
        spec = adapter.spec(ckpt)
        plan = make_plan(ckpt, spec, ep_size=ep_size, tp_size=tp_size, placement=placement,
                         pad_multiple=pad_multiple, max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
        if dry_run:
            return plan
        chosen = list(plan.ranks) if ranks is None else [r for r in plan.ranks if r.rank in set(ranks)]
        if ranks is not None and len(chosen) != len(set(ranks)):
            raise MoeshardError(f"--ranks {','.join(map(str, ranks))}: the sharding has ranks 0..{len(plan.ranks) - 1}")
        args = {"ep_size": ep_size, "tp_size": tp_size, "placement": placement, "pad_multiple": plan.pad_multiple,
                "max_shard_bytes": max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
                "ranks": [r.rank for r in chosen], "common": common}
        tick = progress or (lambda n, what: None)
        if hasattr(tick, "total"):
            tick.total(sum(f.nbytes for r in chosen for f in r.files) + (sum(f.nbytes for f in plan.common) if common else 0))
        if group.leader and not resume:
            check_free_space(out, sum(f.nbytes for r in chosen for f in r.files)
                             + (sum(f.nbytes for f in plan.common) if common else 0))  # before anything is created
        # Every safetensors file to write, shared out over the processes.
        jobs = [(r, f) for r in chosen for f in r.files] + ([(None, f) for f in plan.common] if common else [])
        od = OutputDir(out, _fingerprint(plan, ckpt, args), overwrite=overwrite, resume=resume,
                       process=group.rank if group.world > 1 else None)
        try:
            manifest, results = _produce(group, plan, ckpt, adapter, od, chosen, jobs, common, resume, device,
                                         chunk_bytes, tick, hub)
        except KeyboardInterrupt:
            n = len(od.done)
            raise Interrupted(f"{out}: interrupted; kept {n} finished file{'s' * (n != 1)} and no manifest (not an "
                              "artifact yet): run the same command with --resume to continue") from None
    reused_bytes = sum(x[4] for x in results)
    return ConvertResult(out, manifest, time.perf_counter() - t0, sum(x[2] for x in results),
                         sum(f.nbytes for _, f in jobs) - reused_bytes, sum(x[3] for x in results), reused_bytes,
                         od.replaced)


def _produce(group: Group, plan: Plan, ckpt: Checkpoint, adapter, od: OutputDir, chosen: list[RankPlan],
             jobs: list, common: bool, resume: bool, device: str, chunk_bytes: int, tick: Progress,
             hub: HubSource | None) -> tuple[dict | None, list]:
    """Write this process's files into ``od``, then (process 0) the indexes, copied files and the
    manifest; every process's ``(error, records, bytes_read, files_reused, bytes_reused)``."""
    spec, out = plan.spec, od.out
    mine = jobs[group.rank::group.world]
    with ExitStack() as stack:
        if group.leader:
            stack.enter_context(od)
        group.barrier()  # the folder is locked and prepared
        if not group.leader:
            stack.enter_context(od)
        error, records, reused = None, {}, {}
        try:
            reused = {f.path: rec for _, f in mine if (rec := od.reusable(f.path))}
            if resume and group.leader:
                check_free_space(out, plan.total_bytes - sum(rec["bytes"] for rec in reused.values()))
            scales: dict[int, tuple] = {}  # NVFP4 (a13, a2) per layer: read once, the same on every rank
            if spec.quant_format is QuantFormat.NVFP4:
                scales = {layer: adapter.input_scales(ckpt, spec, layer) for layer in spec.moe_layers}
            for r, f in mine:
                if f.path in reused:
                    tick(f.nbytes, f"{f.path} (reused)")
                elif r is not None:
                    od.write(f.path, lambda tmp, r=r, f=f: write_rank_file(
                        plan, ckpt, adapter, r, f, tmp, device, scales, chunk_bytes, tick))
                else:
                    od.write(f.path, lambda tmp, f=f: write_common_file(ckpt, f, tmp, chunk_bytes, tick))
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
            for r in chosen:
                names = {t.name: Path(f.path).name for f in r.files for layer in f.layers
                         for t in plan.layer_tensors(layer, len(r.experts))}
                od.write_text(f"{r.folder}/{INDEX_NAME}",
                              json_text(index_doc(names, sum(f.nbytes for f in r.files))))
            if common:
                names = {n: Path(f.path).name for f in plan.common for n in f.sources}
                od.write_text(f"common/{INDEX_NAME}",
                              json_text(index_doc(names, sum(f.nbytes for f in plan.common))))
            for name in plan.copied:
                od.copy(name, ckpt.file(name))
            files.update(od.records())
            # What the manifest says of the source: a Hub repo by id and commit, a local folder by
            # its name only (the manifest is published by push); this machine's path goes to the
            # local note, for validate.
            source_info = {"name": ckpt.root.name, "repo_id": None, "revision": None, "commit": None,
                           "files": {n: {"bytes": (ckpt.root / n).stat().st_size} for n in ckpt.files}}
            if hub is not None:
                source_info.update(hub.manifest_source(), name=hub.repo_id, files=hub.files)
            manifest = build_manifest(plan, files, source_info, chosen, common)
            od.finish(manifest, {"source": str(ckpt.root.resolve())})
        group.barrier()  # followers return once the manifest is written
    return manifest, results


__all__ = ["ConvertResult", "convert", "kernel_scalars", "layer_scalars", "read_rank_experts"]
