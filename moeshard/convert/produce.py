"""Producing the output files: each rank file front to back, kernel tensor by kernel tensor, chunk
of experts by chunk of experts, straight from the source's memory map into the writer's staging
buffer; each common file read (``preadv``) straight into it."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from moeshard.artifact.writer import SequentialWriter
from moeshard.checkpoints.families import Adapter, ModelSpec, expert_index, expert_runs
from moeshard.checkpoints.safetensors_io import DTYPES, pread_into
from moeshard.checkpoints.source import Checkpoint
from moeshard.convert.plan import CHUNK_BYTES, OutFile, Plan, RankPlan
from moeshard.layouts.kernel import KERNEL_FIELDS, kernel_scalars
from moeshard.layouts.tp import gemm1_rows, gemm2_columns
from moeshard.layouts.trtllm import trtllm_tensor

#: progress(bytes_done_now, what): called as bytes are written; progress.total(n) once planned.
Progress = Callable[[int, str], None]
#: How far ahead of the transform the source is read (page cache, which the kernel can reclaim):
#: per-expert checkpoints scatter a chunk's tensors over the file.
PREFETCH_BYTES = 512 << 20


def rank_field(adapter: Adapter, ckpt: Checkpoint, spec: ModelSpec, layer: int, field: str, start: int, stop: int,
               rank: RankPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:meth:`Adapter.read_raw` with the rank's TP slice applied in place: ``[up[s:t] ; gate[s:t]]``
    rows of the GEMM1 fields (a row map), columns ``[s, t)`` of the GEMM2 ones (a view); the
    GEMM2 bias is zero on TP ranks after the first."""
    src, rows = adapter.read_raw(ckpt, spec, layer, field, start, stop)
    i, s, t = spec.intermediate_size, rank.i_start, rank.i_stop
    if (s, t) != (0, i):
        if field.startswith("w13"):
            keep = gemm1_rows(i, s, t)
            rows = keep if rows is None else rows[keep]
        elif field in ("w2", "w2_scale"):
            src = src[:, :, gemm2_columns(s, t, 2 if field == "w2" else spec.quant_format.sf_vec_size)]
    if field == "w2_bias" and rank.tp_rank > 0:
        src = torch.zeros_like(src)
    return src, rows


def layer_scalars(plan: Plan, ckpt: Checkpoint, adapter: Adapter, layer: int, rank: RankPlan,
                  input_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """:func:`kernel_scalars` of one rank's experts of one layer, read from the source
    (``input_scales`` too when None)."""
    spec, n = plan.spec, len(rank.experts)
    parts = [adapter.read_scalars(ckpt, spec, layer, a, b) for a, b in expert_runs(rank.experts)]
    if not parts[0]:  # no per-expert scales (MXFP4)
        return kernel_scalars(spec.activation, n)
    scale_2 = {k: torch.cat([p[k] for p in parts]) for k in ("w1_scale_2", "w3_scale_2", "w2_scale_2")}
    return kernel_scalars(spec.activation, n, scale_2,
                          input_scales if input_scales is not None else adapter.input_scales(ckpt, spec, layer))


def write_rank_file(plan: Plan, ckpt: Checkpoint, adapter: Adapter, rank: RankPlan, f: OutFile, path: Path,
                    scales: dict | None = None, tick: Progress | None = None) -> Future:
    """Write one rank file front to back; a future of its SHA-256 (:meth:`SequentialWriter.close`).

    Each kernel tensor is produced chunk of experts by chunk of experts straight into the
    writer's staging buffer (:func:`trtllm_tensor`: one gather from the source's memory map,
    padding and permutations composed) while earlier buffers are written and hashed, and the
    disk reads the next chunk ahead (``posix_fadvise``). A ``plan.options.device`` other than
    "cpu" runs the gathers there.
    """
    spec, n = plan.spec, len(rank.experts)
    device, chunk_bytes = plan.options.device, plan.options.chunk_bytes
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
            leaves = tuple("." + leaf for leaf in adapter.source_leaves(spec, field))
            sources = [x for x in spec.expert_tensors if x.startswith(prefix + ".") and x.endswith(leaves)]
            ahead = max(1, PREFETCH_BYTES // (per * len(chunks[0])))
            for c in chunks[:ahead]:
                prefetch_experts(ckpt, prefix, sources, c)
            for j, chunk in enumerate(chunks):
                if j + ahead < len(chunks):  # the disk reads chunks ahead while this one is transformed
                    prefetch_experts(ckpt, prefix, sources, chunks[j + ahead])
                dst = w.take(name, per * len(chunk)).view(DTYPES[t.dtype]).view(len(chunk), *t.shape[1:])
                e = 0
                for a, b in expert_runs(chunk):
                    src, rows = rank_field(adapter, ckpt, spec, layer, field, a, b, rank)
                    if device == "cpu":
                        trtllm_tensor(kind, src, rows, *sizes, out=dst[e:e + b - a], gemm2_rows=plan.gemm2_rows)
                    else:
                        dst[e:e + b - a].copy_(trtllm_tensor(kind, src.to(device), rows, *sizes,
                                                             gemm2_rows=plan.gemm2_rows).cpu())
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
    lo, hi, wanted = min(experts), max(experts) + 1, set(experts)
    for name in names:
        e = expert_index(name, prefix)
        if e is None:
            ckpt.prefetch(name, lo, hi)
        elif e in wanted:
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
                fds[info.file] = os.open(ckpt.file(info.file), os.O_RDONLY)
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
