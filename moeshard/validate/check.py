"""The decode check of one MoE layer, at the speed of reading it: each EP group's source experts are
read once, in chunks of experts (memory bounded by :func:`chunk_bytes`, not by the model), and
every TP rank of the group is checked against them in the same pass.

Per chunk and rank: the artifact's rows of those experts are read back the way the kernel reads
them (inverse 128x4 interleave, inverse row permutation, the kernel scalars), dequantized in one
batch, and every expert is run on every token next to the source's experts; the routed partial
output accumulates, padding must be zero, and a sample of experts is rebuilt from the source with
FlashInfer's own per-expert preparation (:func:`moeshard.validate.engines.flashinfer_layout`) and
compared byte for byte: a check that shares none of moeshard's permutation code.

Reading runs ahead on threads (:func:`read_ahead`) over the whole run, across EP groups and
layers, so that the next chunk's bytes (the next layer's, at a layer's end) are read while this
one is checked; on CUDA they are read into pinned memory and copied asynchronously.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from moeshard.checkpoints.families import expert_runs, read_experts
from moeshard.checkpoints.formats import QuantFormat
from moeshard.checkpoints.formats.fp4 import dequantize_mxfp4, dequantize_nvfp4
from moeshard.layouts.canonical import CanonicalExperts, concat_experts, pad_experts, slice_intermediate, unpad_experts
from moeshard.layouts.kernel import kernel_scalars
from moeshard.layouts.tp import gemm1_rows
from moeshard.layouts.trtllm import from_trtllm, to_trtllm_padded
from moeshard.validate.moe import activate


def readers(device: str) -> int:
    """Reader threads (each chunk is started that many + 1 ahead of its check): one on the CPU,
    whose cores the check needs; six feeding a GPU."""
    return 6 if str(device).startswith("cuda") else 1


def chunk_bytes(device: str) -> int:
    """Dequantized float32 bytes of one side (source or artifact) held at once per chunk of
    experts: 256 MiB on the CPU, 1 GiB on a GPU (2 GiB was no faster on an H200 and doubled the
    pinned staging, the first run's allocation cost and the resident memory). Packed, a chunk is
    about a seventh of that per side; with :func:`readers` + 1 chunks in flight, host memory stays
    bounded whatever the model's size (measured in ``bench/``)."""
    return (1 << 30) if str(device).startswith("cuda") else (256 << 20)


@dataclass
class RankResult:
    """What one rank's check of one layer found (accumulated over chunks)."""

    rank: int
    max_abs: float = 0.0
    worst_rel: float = 0.0
    worst_expert: int | None = None
    experts_checked: int = 0
    layout_checked: int = 0
    leaks: list[str] = field(default_factory=list)
    layout_problems: list[str] = field(default_factory=list)
    diagnosis: list[str] = field(default_factory=list)
    got: torch.Tensor | None = None  # routed partial output [T, H], artifact
    want: torch.Tensor | None = None  # the same from the source
    bytes_read: int = 0


def dequantize(c: CanonicalExperts, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """All experts of ``c`` at once: ``w13 [n, 2I, H]`` (rows ``[up ; gate]``, each half with its
    own per-tensor scale for NVFP4) and ``w2 [n, H, I]`` float32."""
    if fmt is QuantFormat.MXFP4:
        return dequantize_mxfp4(c.w13, c.w13_scale), dequantize_mxfp4(c.w2, c.w2_scale)
    n, i = c.num_experts, c.intermediate_size
    rows = torch.cat((c.w3_scale_2.float().view(n, 1).expand(n, i), c.w1_scale_2.float().view(n, 1).expand(n, i)), 1)
    w13 = dequantize_nvfp4(c.w13, c.w13_scale, None).mul_(rows.to(c.w13.device).unsqueeze(-1))
    return w13, dequantize_nvfp4(c.w2, c.w2_scale, c.w2_scale_2.float().to(c.w2.device))


def expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None,
                   b2: torch.Tensor | None, activation: dict, first: int = 0) -> torch.Tensor:
    """Every expert on every token: ``x [T, H]`` (or ``[n, T, H]``, each expert its own tokens) ->
    ``[n, T, H]`` float32. ``activation``'s per-expert tensors (GPT-OSS's) are indexed from
    ``first``."""
    h1 = torch.einsum("th,nih->nti" if x.dim() == 2 else "nth,nih->nti", x, w13)
    if b13 is not None:
        h1 = h1 + b13[:, None, :]
    y = torch.einsum("nti,nhi->nth", activate(h1, activation, slice(first, first + h1.shape[0])), w2)
    return y + b2[:, None, :] if b2 is not None else y


def errors(got: torch.Tensor, want: torch.Tensor) -> list[tuple[float, float]]:
    """Per expert of ``[n, T, H]`` outputs: (max absolute, relative Frobenius) error, one transfer."""
    diff = got - want
    num, den = diff.norm(dim=(1, 2)), want.norm(dim=(1, 2))
    rel = torch.where(den > 0, num / den.clamp(min=torch.finfo(den.dtype).tiny), num)
    return [tuple(r) for r in torch.stack((diff.abs().amax(dim=(1, 2)), rel), 1).tolist()]


@dataclass
class Routing:
    """One layer's tokens and routing: ``x [T, H]`` float32, ``ids``/``weights [T, top_k]``;
    ``on_input``: the router weight scales the expert's input (Llama-4), not its output."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    on_input: bool

    def combine(self, experts: list[int]) -> torch.Tensor:
        """``[T, n]`` float32: each token's routing weight for each of ``experts`` (global ids),
        0 where the token is not routed to it."""
        hit = self.ids.unsqueeze(-1) == torch.as_tensor(experts, device=self.ids.device)
        return (self.weights.float().unsqueeze(-1) * hit).sum(1)

    def add(self, out: torch.Tensor, mix: torch.Tensor, outputs: torch.Tensor, params: tuple) -> None:
        """Add to ``out [T, H]`` the routed outputs of a chunk's experts (``mix`` their
        :meth:`combine`): from ``outputs [n, T, H]`` (each expert on every token) when the weight
        applies to the output; else each expert run again on its weighted tokens (``params``:
        ``(w13, w2, b13, b2, activation)`` of the n experts)."""
        if self.on_input:
            outputs = expert_outputs(mix.T.unsqueeze(-1) * self.x, *params)
            mix = (mix != 0).float()
        out += torch.einsum("tn,nth->th", mix, outputs)


@dataclass
class LayerJob:
    """What checking one EP group of one layer needs; ``ranks``: the group's chosen TP ranks as
    ``(rank entry, reader of its kernel tensors for local experts [k0, k1), pinned or not)``."""

    layer: int
    experts: list[int]  # the group's experts (global ids, local order)
    check: list[int]  # local indices of the experts to check (all, or a sample)
    layout: set[int]  # local indices of the experts rebuilt with FlashInfer's preparation
    ranks: list[tuple]

    def chunks(self, per_expert_bytes: int, device: str) -> list[list[int]]:
        """The checked experts (local indices) in chunks of consecutive ones, :func:`chunk_bytes`
        each (``per_expert_bytes``: float32 bytes of one expert's w13 and w2)."""
        step = max(1, chunk_bytes(device) // max(per_expert_bytes, 1))
        out: list[list[int]] = []
        for a, b in expert_runs(self.check):
            out += [list(range(k, min(k + step, b))) for k in range(a, b, step)]
        return out

    def load(self, chunk: list[int], adapter, ckpt, spec, pin: bool) -> tuple:
        """The chunk's source experts (whole intermediate) and every rank's kernel tensors, on
        the host; pinned when ``pin`` (the artifact's read straight into pinned memory)."""
        glob = [self.experts[k] for k in chunk]
        src = concat_experts([read_experts(adapter, ckpt, spec, self.layer, a, b, pin) for a, b in expert_runs(glob)])
        if pin:
            src = src.replace(**{k: v if v.is_pinned() else v.pin_memory() for k, v in src.__dict__.items()
                                 if isinstance(v, torch.Tensor)})
        return src, [read(chunk[0], chunk[-1] + 1, pin) for _, read in self.ranks]


def read_ahead(loads: Iterable[Callable[[], object]], threads: int) -> Iterator:
    """The results of ``loads`` in order, each started ``threads`` + 1 ahead of its use on
    ``threads`` reader threads (so at most that many results wait in memory)."""
    loads = iter(loads)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moeshard-validate-read") as pool:
        pending = deque(pool.submit(f) for _, f in zip(range(threads + 1), loads))
        while pending:
            result = pending.popleft().result()
            if (f := next(loads, None)) is not None:
                pending.append(pool.submit(f))
            yield result


def _rel(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    diff = (got - want).float()
    denom = want.float().norm().item()
    return diff.abs().max().item(), (diff.norm().item() / denom if denom > 0 else diff.norm().item())


def padding_leaks(c: CanonicalExperts, h: int, i: int, tp_rank: int = 0) -> list[str]:
    """Names of the kernel tensors whose padding (beyond the source's H and the rank's I) is not
    zero, and ``gemm2_bias`` when a TP rank other than 0 carries one (one device sync)."""
    ip, sf = c.intermediate_size, c.sf_vec_size
    checks: dict[str, list[torch.Tensor]] = {}
    for name, t, rows, cols in (("gemm1_weights", c.w13, i, h // 2), ("gemm1_weights_scale", c.w13_scale, i, h // sf)):
        checks[name] = [x for half in (t[:, :ip], t[:, ip:]) for x in (half[:, rows:], half[:, :, cols:])]
    for name, t, rows, cols in (("gemm2_weights", c.w2, h, i // 2), ("gemm2_weights_scale", c.w2_scale, h, i // sf)):
        checks[name] = [t[:, rows:], t[:, :, cols:]]
    if c.w13_bias is not None:
        checks["gemm1_bias"] = [c.w13_bias[:, i:ip], c.w13_bias[:, ip + i:]]
    if c.w2_bias is not None:
        checks["gemm2_bias"] = [c.w2_bias[:, h:]] + ([c.w2_bias] if tp_rank > 0 else [])
    names = [n for n, parts in checks.items() for _ in parts]
    flags = torch.stack([x.view(torch.uint8).any() if x.element_size() == 1 else x.any()
                         for parts in checks.values() for x in parts]).tolist()
    return list(dict.fromkeys(n for n, bad in zip(names, flags) if bad))


def differences(kt: dict[str, torch.Tensor], want: dict[str, torch.Tensor], experts: list[int]) -> list[str]:
    """Which stored tensors differ from ``want`` (the same experts' expected kernel tensors), and
    from which expert on: ``name (expert e)``."""
    bad = []
    for name, t in sorted(want.items()):
        got = kt.get(name)
        if got is None or got.shape != t.shape:
            bad.append(f"{name} (missing or shape {None if got is None else list(got.shape)})")
            continue
        a, b = got.reshape(got.shape[0] if got.dim() else 1, -1), t.reshape(t.shape[0] if t.dim() else 1, -1)
        differ = (a.view(torch.uint8) != b.view(torch.uint8)).any(-1) if a.dtype.itemsize == 1 else (a != b).any(-1)
        if differ.any():
            bad.append(f"{name} (expert {experts[int(differ.nonzero()[0])]})" if got.dim() else name)
    return bad


class GroupCheck:
    """The check of one EP group of one layer, fed chunk by chunk (:meth:`add`): per chosen TP
    rank a :class:`RankResult`, and ``want`` the routed output of the group's checked experts
    from the whole (unsliced) source experts, for the comparison of the sum over ranks with the
    full layer."""

    def __init__(self, job: LayerJob, *, spec, routing: Routing, h_pad: int, i_pad: int, gemm2_rows: int, scales,
                 device: str, tol: float, tick: Callable[[int, str], None], layout_cache: dict):
        self.job, self.spec, self.r, self.h_pad, self.i_pad = job, spec, routing, h_pad, i_pad
        self.gemm2_rows = gemm2_rows
        self.scales, self.device, self.tol, self.tick, self.layout_cache = scales, device, tol, tick, layout_cache
        t, h = routing.x.shape[0], spec.hidden_size
        self.results = [RankResult(entry.rank, got=torch.zeros(t, h, device=device),
                                   want=torch.zeros(t, h, device=device)) for entry, _ in job.ranks]
        self.want = torch.zeros(t, h, device=device)

    def add(self, chunk: list[int], src: CanonicalExperts, arts: list[dict[str, torch.Tensor]]) -> None:
        """Check local experts ``chunk`` of every rank: ``src`` their source experts, ``arts`` each
        rank's kernel tensors of them (host or device)."""
        job, spec, r, dev = self.job, self.spec, self.r, self.device
        fmt, h, i = spec.quant_format, spec.hidden_size, spec.intermediate_size
        glob = [job.experts[k] for k in chunk]
        src = src.replace(**{k: v.to(dev, non_blocking=True) for k, v in src.__dict__.items()
                             if isinstance(v, torch.Tensor)})
        mix = r.combine(glob)
        sw13, sw2 = dequantize(src, fmt)  # once per chunk: every TP rank's reference is a cut of it
        s_out = expert_outputs(r.x, sw13, sw2, src.w13_bias, src.w2_bias, spec.activation)
        r.add(self.want, mix, s_out, (sw13, sw2, src.w13_bias, src.w2_bias, spec.activation))
        for (entry, _), kt, res in zip(job.ranks, arts, self.results):
            a, b = entry.intermediate_slice
            ref, rw13, rw2, rb13, rb2, want_e = src, sw13, sw2, src.w13_bias, src.w2_bias, s_out
            if (a, b) != (0, i):  # the rank's TP cut of the source, as convert cuts it
                ref = slice_intermediate(src, a, b)
                rows = gemm1_rows(i, a, b).to(dev)
                rw13, rw2 = sw13.index_select(1, rows), sw2[:, :, a:b]
                rb13 = None if rb13 is None else rb13.index_select(1, rows)
                want_e = None
            if entry.tp_rank > 0 and rb2 is not None:
                ref = ref.replace(w2_bias=torch.zeros_like(rb2))
                rb2, want_e = ref.w2_bias, None
            if want_e is None:
                want_e = expert_outputs(r.x, rw13, rw2, rb13, rb2, spec.activation)
            nbytes = sum(v.numel() * v.element_size() for v in kt.values())
            kt = {k: v.to(dev, non_blocking=True) for k, v in kt.items()}
            art = from_trtllm(kt)
            res.leaks += [x for x in padding_leaks(art, h, b - a, entry.tp_rank) if x not in res.leaks]
            art = unpad_experts(art, h, b - a)  # the padding is zero (else a leak above)
            act = dict(spec.activation)
            if act["type"] == "swiglu_oai":  # the artifact's own per-expert constants
                act.update(alpha=kt["gemm1_alpha"], beta=kt["gemm1_beta"], limit=kt["gemm1_clamp_limit"])
            aw13, aw2 = dequantize(art, fmt)
            got_e = expert_outputs(r.x, aw13, aw2, art.w13_bias, art.w2_bias, act)
            failed = False
            for ge, (mx, rel) in zip(glob, errors(got_e, want_e)):  # each expert alone, on every token
                res.max_abs = max(res.max_abs, mx)
                if rel > res.worst_rel:
                    res.worst_rel, res.worst_expert = rel, ge
                failed |= rel > self.tol
            r.add(res.want, mix, want_e, (rw13, rw2, rb13, rb2, spec.activation))
            r.add(res.got, mix, got_e, (aw13, aw2, art.w13_bias, art.w2_bias, act))
            res.experts_checked += len(chunk)
            self._layout(chunk, glob, ref, kt, res)
            if (failed or res.leaks) and not res.diagnosis:  # which stored tensor, from which expert
                want_t = to_trtllm_padded(ref, self.h_pad, self.i_pad, gemm2_rows=self.gemm2_rows)
                scale_2 = {k: getattr(ref, k) for k in ("w1_scale_2", "w3_scale_2", "w2_scale_2")}
                want_t.update({k: v.to(dev) for k, v in kernel_scalars(
                    spec.activation, len(chunk), scale_2 if self.scales is not None else None, self.scales).items()})
                res.diagnosis = differences(kt, want_t, glob)
            res.bytes_read += nbytes
            self.tick(nbytes, f"rank {entry.rank} layer {job.layer}")

    def _layout(self, chunk: list[int], glob: list[int], ref: CanonicalExperts, kt: dict, res: RankResult) -> None:
        """The sampled experts of the chunk as FlashInfer itself prepares them, byte for byte."""
        from moeshard.validate.engines import flashinfer_layout

        for k, ge in enumerate(glob):
            if chunk[k] in self.job.layout:
                one = _expert(ref, k)
                want_k = flashinfer_layout(pad_experts(one, self.h_pad, self.i_pad), cache=self.layout_cache)
                if self.gemm2_rows != self.h_pad:  # "trimmed": GEMM2's rows padded to fewer than GEMM1's K
                    trimmed = flashinfer_layout(pad_experts(one, self.gemm2_rows, self.i_pad), cache=self.layout_cache)
                    want_k.update({n: v for n, v in trimmed.items() if n.startswith("gemm2")})
                bad = [d.split(" (")[0] for d in differences({n: kt[n][k:k + 1] for n in want_k}, want_k, [ge])]
                if bad:
                    res.layout_problems.append(f"expert {ge}: {', '.join(bad)} differ from FlashInfer's own "
                                               "preparation")
                res.layout_checked += 1


def _expert(c: CanonicalExperts, k: int) -> CanonicalExperts:
    """Expert ``k`` of ``c`` alone (a batch of one)."""
    return c.replace(**{name: v[k:k + 1] for name, v in c.__dict__.items() if isinstance(v, torch.Tensor)})
