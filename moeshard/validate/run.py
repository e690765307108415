"""``moeshard validate``: every chosen rank and layer of an artifact against its source checkpoint."""

from __future__ import annotations

from collections.abc import Callable
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
from moeshard.layouts.kernel import kernel_scalars
from moeshard.layouts.trtllm import from_trtllm, to_trtllm_padded
from moeshard.validate.backends import run_trtllm, select_backend, trtllm_args
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
            w13 = dequantize_nvfp4(c.w13[e].to(device), c.w13_scale[e].to(device), 1.0) * s13
            w2 = dequantize_nvfp4(c.w2[e].to(device), c.w2_scale[e].to(device), c.w2_scale_2[e].to(device))
        b13 = None if c.w13_bias is None else c.w13_bias[e].to(device)
        b2 = None if c.w2_bias is None else c.w2_bias[e].to(device)
        return w13, w2, b13, b2

    return get


def _to(c: CanonicalExperts, device: str) -> CanonicalExperts:
    return c.replace(**{k: v.to(device) for k, v in c.__dict__.items() if isinstance(v, torch.Tensor)})


def _rel(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    diff = (got - want).float()
    denom = want.float().norm().item()
    return diff.abs().max().item(), (diff.norm().item() / denom if denom > 0 else diff.norm().item())


def _padding_leaks(c: CanonicalExperts, h: int, i: int, tp_rank: int = 0) -> list[str]:
    """Names of the kernel tensors whose padding (beyond the source's H and the rank's I) is not
    zero, and ``gemm2_bias`` when a TP rank other than 0 carries one."""
    ip = c.intermediate_size
    sf = c.sf_vec_size
    leaks = []
    for name, t, rows, cols in (("gemm1_weights", c.w13, i, h // 2), ("gemm1_weights_scale", c.w13_scale, i, h // sf)):
        for half in (t[:, :ip], t[:, ip:]):
            if half[:, rows:].any() or half[:, :, cols:].any():
                leaks.append(name)
                break
    for name, t, rows, cols in (("gemm2_weights", c.w2, h, i // 2), ("gemm2_weights_scale", c.w2_scale, h, i // sf)):
        if t[:, rows:].any() or t[:, :, cols:].any():
            leaks.append(name)
    if c.w13_bias is not None and (c.w13_bias[:, i:ip].any() or c.w13_bias[:, ip + i:].any()):
        leaks.append("gemm1_bias")
    if c.w2_bias is not None and (c.w2_bias[:, h:].any() or (tp_rank > 0 and c.w2_bias.any())):
        leaks.append("gemm2_bias")
    return leaks


def _diagnose(kt: dict[str, torch.Tensor], want: dict[str, torch.Tensor], experts: list[int]) -> str:
    """Which stored tensors differ from the conversion of the source, and from which expert on."""
    bad = []
    for name, t in sorted(want.items()):
        got = kt.get(name)
        if got is None or got.shape != t.shape:
            bad.append(f"{name} (missing or shape {None if got is None else list(got.shape)})")
            continue
        a, b = got.reshape(got.shape[0] if got.dim() else 1, -1), t.reshape(t.shape[0] if t.dim() else 1, -1)
        differ = (a.view(torch.uint8) != b.view(torch.uint8)).any(dim=-1) if a.dtype.itemsize == 1 else (a != b).any(-1)
        if differ.any():
            first = int(differ.nonzero()[0])
            bad.append(f"{name} (expert {experts[first]})" if got.dim() else name)
    return ", ".join(bad)


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


def validate(out: Path, *, source: Path | None = None, layers: list[int] | None = None,
             ranks: list[int] | None = None, tokens: int = 32, seed: int = 0, backend: str = "auto",
             device: str = "cpu", progress: Callable[[int, str], None] | None = None) -> ValidationReport:
    """Compare every chosen (rank, layer) of artifact ``out`` with the source checkpoint.

    Per layer, hidden states ``[tokens, H]`` float32 are drawn from ``seed + layer`` and routed
    with the source router. Per rank:

    - decode: every local expert on every token (so that no expert escapes for lack of routed
      tokens), the rank's routed partial output, and zero padding, from the artifact read back
      the way the kernel reads it, against the same experts dequantized from the source;
    - trtllm-gen: the kernel's partial output for the rank against the reference on the same
      (bf16 or NVFP4-quantized) activations.

    When every rank is chosen, the sum of the partial outputs is compared with the full layer
    computed from all source experts. A failing rank is named with layer, tensor and expert. An
    artifact the installed FlashInfer lays out otherwise is refused first (:func:`check_layout`).
    """
    out = Path(out)
    m = Manifest.read(out)
    check_layout(m, out / MANIFEST_NAME)
    if tokens < 1:
        raise MoeshardError(f"--tokens: expected a positive integer, found {tokens}")
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
    if hasattr(tick, "total"):
        tick.total(len(layers) * len(ranks))
    rank_folder = {r.rank: artifact_file(out, r.folder) for r in m.ranks}

    with Checkpoint(src, partial=True) as ckpt, \
            Checkpoint(artifact_file(out, m.common.folder) if m.common else src, with_config=False,
                       partial=True) as common:
        adapter = detect(ckpt)
        spec = adapter.spec(ckpt)
        if spec.family.value != m.family:
            raise MoeshardError(f"{src}: source family {spec.family.value} but {out} was made from {m.family}")
        fmt = spec.quant_format
        h = spec.hidden_size
        h_pad, i_pad = m.padding.hidden_size_padded, m.padding.intermediate_size_padded
        for layer in layers:
            entry = m.layer(layer)
            args = entry.kernel_args
            x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(seed + layer)).to(device)
            router = {k: common.read(v.format(layer=layer)).float().to(device) for k, v in spec.router.items()}
            logits = x @ router["weight"].T
            if "bias" in router:
                logits = logits + router["bias"]
            ids, weights = route(logits, args, router.get("correction_bias"))
            on_input = bool(args.get("apply_weight_on_input"))
            x_pad = torch.nn.functional.pad(x, (0, h_pad - h))
            scales = adapter.input_scales(ckpt, spec, layer)
            sum_got = torch.zeros(tokens, h, device=device)
            x_ref = x  # the activations the reference sees (the kernel's, for trtllm-gen)
            for r in ranks:
                info = m.rank(r)
                experts, n = list(info.experts), info.local_num_experts
                where = f"{info.folder}: {entry.prefix}"
                ref = _to(read_rank_experts(adapter, ckpt, spec, layer, experts, *info.intermediate_slice,
                                            info.tp_rank), device)
                with Checkpoint(rank_folder[r], with_config=False) as rf:
                    names = [k for k in rf.tensors if k.startswith(entry.prefix + ".")]
                    if not names:
                        raise MoeshardError(f"{rf.root}: no tensors under {entry.prefix}")
                    kt = {k[len(entry.prefix) + 1:]: rf.read(k).to(device) for k in names}
                checks: list[tuple[float, float, int | None]] = []
                if backend == "trtllm-gen":
                    kargs, x_used = trtllm_args(kt, args, {"local_expert_offset": info.local_expert_offset,
                                                          "local_num_experts": n}, x_pad, logits,
                                                router.get("correction_bias"))
                    x_ref = x_used[:, :h]
                    got = run_trtllm(kargs)[:, :h]
                    want = moe_forward(x_ref, expert_fn(ref, fmt, device), experts, ids, weights, spec.activation,
                                       on_input)
                    checks.append((*_rel(got, want), None))
                    leaks: list[str] = []
                else:
                    art = from_trtllm(kt)
                    act = dict(spec.activation)
                    if act["type"] == "swiglu_oai":
                        act.update(alpha=kt["gemm1_alpha"], beta=kt["gemm1_beta"], limit=kt["gemm1_clamp_limit"])
                    a, b = info.intermediate_slice
                    leaks = _padding_leaks(art, h, b - a, info.tp_rank)
                    src_fn, art_fn = expert_fn(ref, fmt, device), expert_fn(art, fmt, device)
                    ones = torch.ones(tokens, 1, device=device)
                    for ge in experts:  # each expert alone, on every token
                        one = torch.full((tokens, 1), ge, device=device, dtype=torch.long)
                        want_e = moe_forward(x, src_fn, experts, one, ones, spec.activation)
                        got_e = moe_forward(x_pad, art_fn, experts, one, ones, act)[:, :h]
                        checks.append((*_rel(got_e, want_e), ge))
                    want = moe_forward(x, src_fn, experts, ids, weights, spec.activation, on_input)
                    got = moe_forward(x_pad, art_fn, experts, ids, weights, act, on_input)[:, :h]
                    checks.append((*_rel(got, want), None))
                max_abs = max(c[0] for c in checks)
                rel = max(c[1] for c in checks)
                # Name the worst single expert when one fails on its own, else the routed output.
                worst = max(checks, key=lambda c: (c[2] is not None and c[1] > tol, c[1]))
                ok = rel <= tol and not leaks
                detail = ""
                if not ok:
                    want_t = to_trtllm_padded(ref, h_pad, i_pad, gemm2_rows=m.padding.gemm2_rows)
                    want_t.update({k: v.to(device) for k, v in
                                   kernel_scalars(spec.activation, n, {k: getattr(ref, k) for k in (
                                       "w1_scale_2", "w3_scale_2", "w2_scale_2")}, scales).items()})
                    bad = _diagnose(kt, want_t, experts)
                    what = (f"padding not zero in {', '.join(leaks)}" if leaks else
                            f"relative error {worst[1]:.3g} > {tol:g}" +
                            (f" at expert {worst[2]}" if worst[2] is not None else " on the routed output"))
                    detail = f"{where}: {what}" + (f"; differs from the converted source: {bad}" if bad else "")
                report.rows.append(Row(r, layer, backend, max_abs, rel, ok, detail, None if ok else worst[2]))
                sum_got += got
                tick(1, f"rank {r} layer {layer}")
            if sorted(ranks) == all_ranks and len(all_ranks) == m.rank_count > 1:
                full = _to(read_experts(adapter, ckpt, spec, layer, 0, spec.num_experts), device)
                want = moe_forward(x_ref, expert_fn(full, fmt, device), range(spec.num_experts), ids, weights,
                                   spec.activation, on_input)
                max_abs, rel = _rel(sum_got, want)
                ok = rel <= tol
                report.rows.append(Row("sum", layer, backend, max_abs, rel, ok,
                                       "" if ok else f"layer {layer}: sum over ranks differs from the full layer "
                                       f"(relative error {rel:.3g} > {tol:g})"))
    return report
