"""``moeshard validate``: every chosen rank and layer of an artifact against its source checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moeshard.artifact.load import check_layout
from moeshard.artifact.manifest import LOCAL_NAME, MANIFEST_NAME, Manifest, artifact_file
from moeshard.checkpoints.families import detect, read_experts, read_rank_experts
from moeshard.checkpoints.formats import QuantFormat
from moeshard.checkpoints.formats.fp4 import dequantize_mxfp4, dequantize_nvfp4
from moeshard.checkpoints.source import Checkpoint
from moeshard.errors import MoeshardError
from moeshard.files import load_json
from moeshard.layouts.canonical import CanonicalExperts
from moeshard.validate.backends import run_trtllm, select_backend, trtllm_args
from moeshard.validate.check import GroupCheck, LayerJob, RankResult, Routing, _rel, read_ahead, readers
from moeshard.validate.moe import moe_forward, route

#: Relative error (Frobenius) above which a check fails. decode runs the same fp32 math as the
#: reference on the same dequantized values (only summation order differs); trtllm-gen also
#: quantizes its GEMM1 output and accumulates in lower precision.
TOLERANCE = {"decode": 1e-5, "trtllm-gen": 5e-2}


@dataclass
class Row:
    rank: int | str
    layer: int
    backend: str
    max_abs_error: float
    rel_error: float
    passed: bool
    detail: str = ""
    worst_expert: int | None = None
    experts_checked: int = 0
    layout_checked: int = 0  # experts compared with FlashInfer's own preparation


@dataclass
class ValidationReport:
    artifact: str
    source: str
    backend: str
    device: str
    tokens: int
    seed: int
    tolerance: float
    notes: list[str] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    coverage: dict = field(default_factory=dict)  # layers, ranks, experts: [checked, of]
    layers: list[dict] = field(default_factory=list)  # per layer: checks, worst error and where, seconds

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    def to_json(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d


def expert_fn(c: CanonicalExperts, fmt: QuantFormat, device: str) -> Callable[[int], tuple]:
    """Local expert e of canonical experts -> float32 ``(w13, w2, b13, b2)`` on ``device``,
    dequantized one expert at a time (MXFP4: UE8M0 scales; NVFP4: E4M3 x weight_scale_2)."""

    def get(e: int) -> tuple:
        if fmt is QuantFormat.MXFP4:
            w13 = dequantize_mxfp4(c.w13[e].to(device), c.w13_scale[e].to(device))
            w2 = dequantize_mxfp4(c.w2[e].to(device), c.w2_scale[e].to(device))
        else:
            i = c.intermediate_size  # rows [up ; gate]: each half with its own scale
            s13 = torch.cat((c.w3_scale_2[e].expand(i), c.w1_scale_2[e].expand(i))).to(device).unsqueeze(-1)
            w13 = dequantize_nvfp4(c.w13[e].to(device), c.w13_scale[e].to(device), None) * s13
            w2 = dequantize_nvfp4(c.w2[e].to(device), c.w2_scale[e].to(device), c.w2_scale_2[e].to(device))
        b13 = None if c.w13_bias is None else c.w13_bias[e].to(device)
        b2 = None if c.w2_bias is None else c.w2_bias[e].to(device)
        return w13, w2, b13, b2

    return get


def source_folder(out: Path, m: Manifest) -> Path:
    """The artifact's source checkpoint on this machine: the folder the conversion noted locally
    (:data:`LOCAL_NAME`), or, for a Hub source, its snapshot in the local Hub cache."""
    note = out / LOCAL_NAME
    if note.is_file():
        path = load_json(note).get("source")
        if isinstance(path, str) and Path(path).is_dir():
            return Path(path)
    src = m.source
    if src.repo_id and src.commit:
        from huggingface_hub import constants

        snap = Path(constants.HF_HUB_CACHE) / f"models--{src.repo_id.replace('/', '--')}" / "snapshots" / src.commit
        if snap.is_dir():
            return snap
    raise MoeshardError(f"{out}: its source ({src.label()}) is not on this machine; pass --source FOLDER")


def _sample(n: int, k: int | None, seed: int) -> list[int]:
    """``k`` of ``range(n)`` drawn with ``seed`` (all when k is None or >= n), sorted."""
    if k is None or k >= n:
        return list(range(n))
    return sorted(torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].tolist())


def validate(out: Path, *, source: Path | None = None, layers: list[int] | None = None,
             ranks: list[int] | None = None, experts: int | None = None, tokens: int = 32, seed: int = 0,
             backend: str = "auto", device: str = "cpu", full: bool = False, layout_sample: int = 2,
             progress: Callable[[int, str], None] | None = None) -> ValidationReport:
    """Compare every chosen (rank, layer) of artifact ``out`` with the source checkpoint.

    Per layer, hidden states ``[tokens, H]`` float32 are drawn from ``seed + layer`` and routed
    with the source router. ``experts`` checks a seeded sample of that many experts per layer
    (default: all). Per rank:

    - decode (:mod:`moeshard.validate.check`): every checked expert on every token (so that no
      expert escapes for lack of routed tokens), the rank's routed partial output and zero
      padding, from the artifact read back the way the kernel reads it, against the same experts
      dequantized from the source; and ``layout_sample`` experts per rank and layer (all with
      ``full``) rebuilt from the source with FlashInfer's own per-expert preparation, byte for
      byte. Each layer's source and artifact bytes are read once, in bounded chunks;
    - trtllm-gen: the kernel's partial output for the rank against the reference on the same
      (bf16 or NVFP4-quantized) activations.

    When every rank and expert is checked, the sum of the partial outputs is compared with the
    full layer computed from all source experts. A failing rank is named with layer, tensor and
    expert. An artifact the installed FlashInfer lays out otherwise is refused first
    (:func:`~moeshard.artifact.load.check_layout`).
    """
    out = Path(out)
    m = Manifest.read(out)
    check_layout(m, out / MANIFEST_NAME)
    if tokens < 1:
        raise MoeshardError(f"--tokens: expected a positive integer, found {tokens}")
    if experts is not None and experts < 1:
        raise MoeshardError(f"--experts: expected a positive integer, found {experts}")
    src = Path(source) if source is not None else source_folder(out, m)
    backend, note = select_backend(backend, device)
    tol = TOLERANCE[backend]
    report = ValidationReport(str(out), str(src), backend, device, tokens, seed, tol, [note] if note else [])
    all_layers = [entry.layer for entry in m.moe_layers]
    layers = all_layers if layers is None else layers
    all_ranks = [r.rank for r in m.ranks]
    ranks = all_ranks if ranks is None else ranks
    for x in layers:
        if x not in all_layers:
            raise MoeshardError(f"--layers {x}: not a MoE layer of {out} (MoE layers: "
                                f"{all_layers[0]}..{all_layers[-1]})")
    for r in ranks:
        if r not in all_ranks:
            raise MoeshardError(f"--ranks {r}: {out} has ranks 0..{len(all_ranks) - 1}")
    if backend == "trtllm-gen" and m.placement != "contiguous":
        raise MoeshardError(f"{out}: placement {m.placement}: FlashInfer's from-logits trtllm-gen kernel needs each "
                            "rank's experts contiguous; use --backend decode")
    tick = progress or (lambda n, what: None)

    with ExitStack() as stack:
        ckpt = stack.enter_context(Checkpoint(src, partial=True))
        common = stack.enter_context(Checkpoint(artifact_file(out, m.common.folder) if m.common else src,
                                                with_config=False, partial=True))
        rank_files = {r: stack.enter_context(Checkpoint(artifact_file(out, m.rank(r).folder), with_config=False))
                      for r in ranks}
        adapter = detect(ckpt)
        spec = adapter.spec(ckpt)
        if spec.family.value != m.family:
            raise MoeshardError(f"{src}: source family {spec.family.value} but {out} was made from {m.family}")
        h_pad, i_pad = m.padding.hidden_size_padded, m.padding.intermediate_size_padded
        layer_bytes = {(r, x): sum(t.nbytes for k, t in rank_files[r].tensors.items()
                                   if k.startswith(m.layer(x).prefix + ".")) for r in ranks for x in layers}
        if hasattr(tick, "total"):
            tick.total(sum(layer_bytes.values()))
        sampled = experts is not None and experts < m.num_experts
        report.coverage = {"layers": [len(layers), len(all_layers)], "ranks": [len(ranks), m.rank_count],
                           "experts": [min(experts or m.num_experts, m.num_experts), m.num_experts],
                           "layout_experts_per_rank": "all" if full else layout_sample}
        jobs = {layer: _jobs(m, layer, ranks, rank_files, _sample(m.num_experts, experts, seed + layer),
                             None if full else layout_sample, seed) for layer in layers}
        per_expert = 12 * spec.hidden_size * spec.intermediate_size  # float32 bytes of w13 and w2
        pin = str(device).startswith("cuda")
        work = [(job, chunk) for layer in layers for job in jobs[layer] for chunk in job.chunks(per_expert, device)]
        loaded = read_ahead(((lambda job=job, chunk=chunk: job.load(chunk, adapter, ckpt, spec, pin))
                             for job, chunk in (work if backend == "decode" else [])), readers(device))
        stack.callback(loaded.close)
        layout_cache: dict = {}
        for layer in layers:
            t0 = time.perf_counter()
            entry = m.layer(layer)
            x = torch.randn(tokens, spec.hidden_size, generator=torch.Generator().manual_seed(seed + layer)).to(device)
            router = {k: common.read(v.format(layer=layer)).float().to(device) for k, v in spec.router.items()}
            logits = x @ router["weight"].T
            if "bias" in router:
                logits = logits + router["bias"]
            ids, weights = route(logits, entry.kernel_args, router.get("correction_bias"))
            on_input = bool(entry.kernel_args.get("apply_weight_on_input"))
            if backend == "trtllm-gen":
                rows = [_trtllm_rank(m.rank(r), entry, rank_files[r], adapter, ckpt, spec, x, logits, ids, weights,
                                     router, device, tol) for r in ranks]
                sum_got, want_full = sum(row_got for _, row_got in rows), None
                rows = [row for row, _ in rows]
            else:
                routing = Routing(x, ids, weights, on_input)
                scales = adapter.input_scales(ckpt, spec, layer)
                rows, sum_got, want_full = [], torch.zeros(tokens, spec.hidden_size, device=device), \
                    torch.zeros(tokens, spec.hidden_size, device=device)
                for job in jobs[layer]:
                    group = GroupCheck(job, spec=spec, routing=routing, h_pad=h_pad, i_pad=i_pad,
                                       gemm2_rows=m.padding.gemm2_rows, scales=scales,
                                       device=device, tol=tol, tick=tick, layout_cache=layout_cache)
                    for chunk in job.chunks(per_expert, device):
                        group.add(chunk, *next(loaded))
                    want_full += group.want
                    for (e, _), res in zip(job.ranks, group.results):
                        rows.append(_decode_row(e, entry, res, tol))
                        sum_got += res.got
            report.rows += rows
            if sorted(ranks) == all_ranks and len(all_ranks) == m.rank_count > 1 and not sampled:
                if want_full is None:  # trtllm-gen: the reference on the kernel's own activations
                    full = read_experts(adapter, ckpt, spec, layer, 0, spec.num_experts)
                    want_full = moe_forward(x, expert_fn(full, spec.quant_format, device), range(spec.num_experts),
                                            ids, weights, spec.activation, on_input)
                max_abs, rel = _rel(sum_got, want_full)
                ok = rel <= tol
                report.rows.append(Row("sum", layer, backend, max_abs, rel, ok,
                                       "" if ok else f"layer {layer}: sum over ranks differs from the full layer "
                                       f"(relative error {rel:.3g} > {tol:g})"))
            if str(device).startswith("cuda"):
                torch.cuda.synchronize()
            report.layers.append(_layer_summary(layer, [r for r in report.rows if r.layer == layer],
                                                time.perf_counter() - t0,
                                                sum(layer_bytes[(r, layer)] for r in ranks)))
    return report


def _jobs(m: Manifest, layer: int, ranks: list[int], rank_files: dict, chosen: list[int], layout: int | None,
          seed: int) -> list[LayerJob]:
    """One job per EP group of the chosen ranks: its experts, the chosen ones among them, and
    ``layout`` of those (all when None) for the FlashInfer layout check, drawn per group."""
    chosen, entry, out = set(chosen), m.layer(layer), []
    for ep_rank in sorted({m.rank(r).ep_rank for r in ranks}):
        members = [m.rank(r) for r in ranks if m.rank(r).ep_rank == ep_rank]
        group = list(members[0].experts)
        check = [k for k, ge in enumerate(group) if ge in chosen]
        pick = _sample(len(check), layout, seed + layer + 7919 * ep_rank)
        out.append(LayerJob(layer, group, check, {check[k] for k in pick},
                            [(e, _reader(rank_files[e.rank], entry.prefix)) for e in members]))
    return out


def _reader(rf: Checkpoint, prefix: str) -> Callable[..., dict[str, torch.Tensor]]:
    """Reads a rank's kernel tensors of one layer for local experts ``[k0, k1)`` (``[]``-shaped
    tensors whole), into pinned memory when asked."""
    names = [k for k in rf.tensors if k.startswith(prefix + ".")]
    if not names:
        raise MoeshardError(f"{rf.root}: no tensors under {prefix}")

    def read(k0: int, k1: int, pin: bool = False) -> dict[str, torch.Tensor]:
        return {k[len(prefix) + 1:]: rf.read(k, k0, k1, pin=pin) if rf.tensors[k].shape else rf.read(k, pin=pin)
                for k in names}

    return read


def _decode_row(e, entry, res: RankResult, tol: float) -> Row:
    """One rank's row from its decode check: the worst of every expert alone and the routed output."""
    routed_abs, routed_rel = _rel(res.got, res.want)
    max_abs, rel = max(res.max_abs, routed_abs), max(res.worst_rel, routed_rel)
    worst = res.worst_expert if res.worst_rel > tol else None
    problems = [f"padding not zero in {', '.join(res.leaks)}"] if res.leaks else []
    if rel > tol:
        problems.append(f"relative error {rel:.3g} > {tol:g}" + (f" at expert {worst}" if worst is not None else
                                                                " on the routed output"))
    if res.layout_problems:
        problems.append(f"layout check: {'; '.join(res.layout_problems)}")
    detail = f"{e.folder}: {entry.prefix}: {'; '.join(problems)}" if problems else ""
    if problems and res.diagnosis:
        detail += f"; differs from the converted source: {', '.join(res.diagnosis)}"
    return Row(e.rank, entry.layer, "decode", max_abs, rel, not problems, detail, worst, res.experts_checked,
               res.layout_checked)


def _layer_summary(layer: int, rows: list[Row], seconds: float, nbytes: int) -> dict:
    worst = max(rows, key=lambda r: r.rel_error) if rows else None
    return {"layer": layer, "checks": len(rows), "passed": all(r.passed for r in rows),
            "worst_rel_error": worst.rel_error if worst else None, "worst_rank": worst.rank if worst else None,
            "worst_expert": worst.worst_expert if worst else None, "seconds": round(seconds, 3),
            "artifact_bytes": nbytes}


def _trtllm_rank(info, entry, rf: Checkpoint, adapter, ckpt, spec, x, logits, ids, weights, router, device,
                 tol) -> tuple[Row, torch.Tensor]:
    """The trtllm-gen kernel's partial output of one rank (Blackwell only) against the reference
    on the same activations."""
    experts, n = list(info.experts), info.local_num_experts
    h, h_pad = spec.hidden_size, entry.kernel_args["hidden_size"]
    ref = read_rank_experts(adapter, ckpt, spec, entry.layer, experts, *info.intermediate_slice, info.tp_rank)
    ref = ref.replace(**{k: v.to(device) for k, v in ref.__dict__.items() if isinstance(v, torch.Tensor)})
    kt = {k: v.to(device) for k, v in _reader(rf, entry.prefix)(0, n).items()}
    kargs, x_used = trtllm_args(kt, entry.kernel_args, {"local_expert_offset": info.local_expert_offset,
                                                        "local_num_experts": n},
                                torch.nn.functional.pad(x, (0, h_pad - h)), logits, router.get("correction_bias"))
    got = run_trtllm(kargs)[:, :h]
    want = moe_forward(x_used[:, :h], expert_fn(ref, spec.quant_format, device), experts, ids, weights,
                       spec.activation, bool(entry.kernel_args.get("apply_weight_on_input")))
    max_abs, rel = _rel(got, want)
    ok = rel <= tol
    return Row(info.rank, entry.layer, "trtllm-gen", max_abs, rel, ok,
               "" if ok else f"{info.folder}: {entry.prefix}: relative error {rel:.3g} > {tol:g} on the routed output",
               None, n, 0), got
