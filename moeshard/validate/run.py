"""``moeshard validate``: every chosen rank and layer of an artifact against its source checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moeshard.convert.families import QuantFormat, detect
from moeshard.convert.manifest import read_manifest
from moeshard.convert.source import Checkpoint
from moeshard.errors import MoeshardError
from moeshard.layouts.canonical import CanonicalExperts
from moeshard.layouts.trtllm import from_trtllm
from moeshard.quant import dequantize_mxfp4, dequantize_nvfp4
from moeshard.validate.moe import moe_forward, route

#: Relative error (Frobenius) above which a rank fails. The decode backend runs the same fp32
#: math as the reference on the same dequantized values; only summation order differs.
DECODE_TOLERANCE = 1e-5


@dataclass
class Row:
    rank: int | str
    layer: int
    backend: str
    max_abs_error: float
    rel_error: float
    passed: bool
    detail: str = ""


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
            w13 = dequantize_nvfp4(c.w13[e].to(device), c.w13_scale[e].to(device), c.w13_scale_2[e].to(device))
            w2 = dequantize_nvfp4(c.w2[e].to(device), c.w2_scale[e].to(device), c.w2_scale_2[e].to(device))
        b13 = None if c.w13_bias is None else c.w13_bias[e].to(device)
        b2 = None if c.w2_bias is None else c.w2_bias[e].to(device)
        return w13, w2, b13, b2

    return get


def _compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    diff = (got - want).float()
    denom = want.float().norm().item()
    rel = diff.norm().item() / denom if denom > 0 else diff.norm().item()
    return diff.abs().max().item(), rel


def _rank_tensors(folder: Checkpoint, prefix: str) -> dict[str, torch.Tensor]:
    names = [n for n in folder.tensors if n.startswith(prefix + ".")]
    if not names:
        raise MoeshardError(f"{folder.root}: no tensors under {prefix}")
    return {n[len(prefix) + 1:]: folder.read(n) for n in names}


def validate(out: Path, *, source: Path | None = None, layers: list[int] | None = None,
             ranks: list[int] | None = None, tokens: int = 32, seed: int = 0, backend: str = "auto",
             device: str = "cpu", progress: Callable[[str], None] | None = None) -> ValidationReport:
    """Compare every chosen (rank, layer) of artifact ``out`` with the source checkpoint.

    Per layer: hidden states ``[tokens, H]`` float32 drawn from ``seed + layer``, routed with the
    source router; each rank's partial output (its experts only) from the artifact against the
    same experts dequantized from the source; when every rank is chosen, the sum over ranks
    against the full layer. Returns a report; ``report.passed`` is False on any failure.
    """
    out = Path(out)
    m = read_manifest(out)
    src = Path(source) if source is not None else Path(m["source"]["path"])
    if backend not in ("auto", "decode"):
        raise MoeshardError(f"--backend {backend}: expected auto or decode")
    report = ValidationReport(str(out), str(src), "decode", device, tokens, seed, DECODE_TOLERANCE)
    if backend == "auto":
        report.notes.append("backend auto: the trtllm-gen kernel is not used; decode reads the artifact "
                            "the way the kernel does and runs the same MoE math")
    all_layers = [entry["layer"] for entry in m["moe_layers"]]
    layers = all_layers if layers is None else layers
    all_ranks = [r["rank"] for r in m["ranks"]]
    ranks = all_ranks if ranks is None else ranks
    for x in layers:
        if x not in all_layers:
            raise MoeshardError(f"--layers {x}: not a MoE layer of {out} (MoE layers: {all_layers[0]}..{all_layers[-1]})")
    for r in ranks:
        if r not in all_ranks:
            raise MoeshardError(f"--ranks {r}: {out} has ranks 0..{len(all_ranks) - 1}")
    tick = progress or (lambda what: None)

    with Checkpoint(src) as ckpt, Checkpoint(out / "common", with_config=False) as common:
        adapter = detect(ckpt)
        spec = adapter.spec(ckpt)
        if spec.family.value != m["family"]:
            raise MoeshardError(f"{src}: source family {spec.family.value} but {out} was made from {m['family']}")
        fmt = spec.quant_format
        h = spec.hidden_size
        h_pad = m["padding"]["hidden_size_padded"]
        rank_info = {r["rank"]: r for r in m["ranks"]}
        for layer in layers:
            entry = next(e for e in m["moe_layers"] if e["layer"] == layer)
            g = torch.Generator().manual_seed(seed + layer)
            x = torch.randn(tokens, h, generator=g).to(device)
            router = {k: common.read(v.format(layer=layer)).float().to(device) for k, v in spec.router.items()}
            logits = x @ router["weight"].T
            if "bias" in router:
                logits = logits + router["bias"]
            ids, weights = route(logits, entry["kernel_args"], router.get("correction_bias"))
            on_input = bool(entry["kernel_args"].get("apply_weight_on_input"))
            x_pad = torch.nn.functional.pad(x, (0, h_pad - h))
            every = sorted(ranks) == all_ranks and len(all_ranks) > 1
            sum_got = torch.zeros(tokens, h, device=device)
            for r in ranks:
                info = rank_info[r]
                e0, n = info["local_expert_offset"], info["local_num_experts"]
                tick(f"rank {r} layer {layer}")
                ref = adapter.read_experts(ckpt, spec, layer, e0, e0 + n)
                want = moe_forward(x, expert_fn(ref, fmt, device), n, ids, weights, spec.activation, e0, on_input)
                with Checkpoint(out / info["folder"], with_config=False) as rf:
                    kt = _rank_tensors(rf, entry["prefix"])
                act = dict(spec.activation)
                if act["type"] == "swiglu_oai":
                    act.update(alpha=kt["gemm1_alpha"], beta=kt["gemm1_beta"], limit=kt["gemm1_clamp_limit"])
                got_full = moe_forward(x_pad, expert_fn(from_trtllm(kt), fmt, device), n, ids, weights, act, e0,
                                       on_input)
                got = got_full[:, :h]
                max_abs, rel = _compare(got, want)
                pad_leak = got_full[:, h:].abs().max().item() if h_pad > h else 0.0
                ok = rel <= DECODE_TOLERANCE and pad_leak == 0.0
                where = f"{info['folder']}: {entry['prefix']}"
                detail = ("" if ok else f"{where}: padded output columns non-zero ({pad_leak:.3g})" if pad_leak
                          else f"{where}: output differs from the source (relative error {rel:.3g} > {DECODE_TOLERANCE:g})")
                report.rows.append(Row(r, layer, report.backend, max_abs, rel, ok, detail))
                sum_got += got
            if every:
                tick(f"all experts layer {layer}")
                full = adapter.read_experts(ckpt, spec, layer, 0, spec.num_experts)
                want = moe_forward(x, expert_fn(full, fmt, device), spec.num_experts, ids, weights, spec.activation, 0,
                                   on_input)
                max_abs, rel = _compare(sum_got, want)
                ok = rel <= DECODE_TOLERANCE
                report.rows.append(Row("sum", layer, report.backend, max_abs, rel, ok,
                                       "" if ok else f"layer {layer}: sum over ranks differs from the full layer"))
    return report


def _dev(t: torch.Tensor | None, device: str) -> torch.Tensor | None:
    return None if t is None else t.to(device)
