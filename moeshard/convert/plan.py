"""Plan a conversion from headers alone: which ranks own which experts, which output file holds
which tensors, with every shape and dtype known before a weight byte is read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from moeshard.convert.families import ModelSpec, QuantFormat
from moeshard.convert.io import GB, pack_groups, shard_names
from moeshard.convert.source import Checkpoint
from moeshard.errors import MoeshardError
from moeshard.layouts.trtllm import EPILOGUE_TILE_M

#: Non-tensor files copied unchanged from the source into the artifact.
COPIED_FILES = ("config.json", "generation_config.json", "hf_quant_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
DEFAULT_MAX_SHARD_BYTES = 5 * GB
#: Pad H and the per-rank I to a multiple of this by default: 256 for GPT-OSS (vLLM's choice for
#: trtllm-gen), 128 for NVFP4 (the kernel's row tile; the real DeepSeek-R1 and Llama-4 sizes need none).
DEFAULT_PAD_MULTIPLE = {QuantFormat.MXFP4: 256, QuantFormat.NVFP4: 128}
PLACEMENTS = ("contiguous", "round-robin")
#: Which engines take each expert placement (recorded in the manifest).
PLACEMENT_ENGINES = {
    "contiguous": "FlashInfer trtllm_fp4_block_scale_moe (local_expert_offset = first expert), vLLM and SGLang "
                  "expert parallelism (their default)",
    "round-robin": "engines that route with an explicit expert map (vLLM --expert-placement-strategy round_robin "
                   "with a routed/modular MoE kernel); not FlashInfer's from-logits trtllm_fp4_block_scale_moe, "
                   "which needs each rank's experts contiguous",
}


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: its name (module prefix + FlashInfer argument name), dtype code, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 4 if self.dtype == "F32" else 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class OutFile:
    """One output safetensors file: its path relative to OUT, the MoE layers (rank files) or the
    source tensor names (common files) it holds, and its tensors' total bytes."""

    path: str
    layers: tuple[int, ...]
    sources: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class RankPlan:
    """One output rank: rank = ep_rank * tp_size + tp_rank; its global expert ids (in order) and
    its slice ``[i_start, i_stop)`` of every expert's intermediate dimension."""

    rank: int
    ep_rank: int
    tp_rank: int
    experts: tuple[int, ...]
    i_start: int
    i_stop: int
    files: tuple[OutFile, ...]

    @property
    def contiguous(self) -> bool:
        return list(self.experts) == list(range(self.experts[0], self.experts[0] + len(self.experts)))

    @property
    def folder(self) -> str:
        return f"rank-{self.rank:05d}"


@dataclass(frozen=True)
class Plan:
    source: Path
    spec: ModelSpec
    ep_size: int
    tp_size: int
    placement: str
    pad_multiple: int
    hidden_size_padded: int
    intermediate_size_padded: int
    epilogue_tile_m: int
    ranks: tuple[RankPlan, ...]
    common: tuple[OutFile, ...]
    copied: tuple[str, ...]

    def layer_tensors(self, layer: int, local_experts: int) -> list[OutTensor]:
        """The tensors one rank file holds for one MoE layer (DESIGN.md, "The artifact")."""
        e, h, i = local_experts, self.hidden_size_padded, self.intermediate_size_padded
        sf = self.spec.quant_format.sf_vec_size
        p = self.spec.prefix(layer)
        out = [OutTensor(f"{p}.gemm1_weights", "U8", (e, 2 * i, h // 2)),
               OutTensor(f"{p}.gemm1_weights_scale", "F8_E4M3", (e, 2 * i, h // sf)),
               OutTensor(f"{p}.gemm2_weights", "U8", (e, h, i // 2)),
               OutTensor(f"{p}.gemm2_weights_scale", "F8_E4M3", (e, h, i // sf))]
        if self.spec.quant_format is QuantFormat.MXFP4:
            out += [OutTensor(f"{p}.gemm1_bias", "F32", (e, 2 * i)), OutTensor(f"{p}.gemm2_bias", "F32", (e, h))]
            out += [OutTensor(f"{p}.gemm1_{n}", "F32", (e,)) for n in ("alpha", "beta", "clamp_limit")]
        else:
            out += [OutTensor(f"{p}.{n}", "F32", (e,)) for n in
                    ("output1_scale_scalar", "output1_scale_gate_scalar", "output2_scale_scalar")]
            out.append(OutTensor(f"{p}.hidden_states_scale_global", "F32", ()))
        return out

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for r in self.ranks for f in r.files) + sum(f.nbytes for f in self.common)

    def to_json(self) -> dict:
        """What ``convert --dry-run --json`` prints: per rank its experts, slice and files."""
        return {"ranks": [{"rank": r.rank, "ep_rank": r.ep_rank, "tp_rank": r.tp_rank, "experts": list(r.experts),
                           "intermediate_slice": [r.i_start, r.i_stop],
                           "files": [{"path": f.path, "layers": list(f.layers), "bytes": f.nbytes} for f in r.files]}
                          for r in self.ranks],
                "common_files": [{"path": f.path, "tensors": len(f.sources), "bytes": f.nbytes} for f in self.common],
                "hidden_size_padded": self.hidden_size_padded,
                "intermediate_size_padded": self.intermediate_size_padded, "bytes": self.total_bytes}


def check_kernel_shapes(h_pad: int, i_pad: int, sf: int, where: str) -> None:
    """Refuse padded sizes the trtllm-gen layout cannot take without interleave padding."""
    problems = []
    if h_pad % 128:
        problems.append(f"hidden size {h_pad} (gemm2 rows) not a multiple of 128")
    if (2 * i_pad) % 128:
        problems.append(f"2 x intermediate size {2 * i_pad} (gemm1 rows) not a multiple of 128")
    if (h_pad // sf) % 4 or (i_pad // sf) % 4:
        problems.append(f"scale columns {h_pad // sf}, {i_pad // sf} not multiples of 4")
    if h_pad % sf or i_pad % sf:
        problems.append(f"sizes {h_pad}, {i_pad} not multiples of the scale block {sf}")
    if problems:
        raise MoeshardError(f"{where}: {'; '.join(problems)}")


def rank_experts(num_experts: int, ep_size: int, tp_size: int, placement: str, rank: int) -> tuple[int, ...]:
    """The experts of output rank ``rank`` (= ep_rank * tp_size + tp_rank)."""
    ep_rank, local = rank // tp_size, num_experts // ep_size
    if placement == "contiguous":
        return tuple(range(ep_rank * local, (ep_rank + 1) * local))
    return tuple(range(ep_rank, num_experts, ep_size))


def tp_slices(spec: ModelSpec, tp_size: int) -> list[tuple[int, int]]:
    """Each TP rank's ``[start, stop)`` of the intermediate dimension, cut on scale blocks.

    GPT-OSS follows vLLM's ``GptOssModel._load_weights_mxfp4``: per-rank I =
    ceil(I / 32 / T) * 32, the last rank shorter. NVFP4 follows vLLM's FusedMoE weight loader:
    I / T each, which must be a whole number of 16-element blocks. Empty ranks are refused.
    """
    i, sf = spec.intermediate_size, spec.quant_format.sf_vec_size
    if spec.quant_format is QuantFormat.MXFP4:
        per = -(-i // sf // tp_size) * sf
    else:
        per = i // tp_size if i % tp_size == 0 and (i // tp_size) % sf == 0 else 0
    out = [(min(r * per, i), min((r + 1) * per, i)) for r in range(tp_size)]
    return out if per and all(b > a for a, b in out) else []


def _largest_valid_tp(spec: ModelSpec, tp_size: int, h_pad: int, pad_multiple: int) -> str:
    """'largest valid --tp-size: T' (T <= tp_size), or that none works with this padding. No T above
    I / sf can give every rank a whole scale block, so at most I / sf sizes are tried."""
    for t in range(min(tp_size, spec.intermediate_size // spec.quant_format.sf_vec_size), 0, -1):
        cuts = tp_slices(spec, t)
        if cuts:
            try:
                i_pad = round_up(max(b - a for a, b in cuts), pad_multiple)
                check_kernel_shapes(h_pad, i_pad, spec.quant_format.sf_vec_size, "")
                return f"largest valid --tp-size: {t}"
            except MoeshardError:
                pass
    return f"no --tp-size works with --pad-multiple {pad_multiple}"


def make_plan(ckpt: Checkpoint, spec: ModelSpec, *, ep_size: int = 1, tp_size: int = 1,
              placement: str = "contiguous", pad_multiple: int | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, epilogue_tile_m: int = EPILOGUE_TILE_M) -> Plan:
    """Plan the artifact of ``ckpt``; raises MoeshardError for splits or paddings the kernel cannot take.

    Rank ``ep_rank * tp_size + tp_rank`` owns EP group ``ep_rank``'s experts (contiguous:
    ``[r*E/ep, (r+1)*E/ep)``; round-robin: ``e % ep == r``) and TP slice ``tp_rank`` of each.
    H and the per-rank I are zero-padded to ``pad_multiple`` (default: per quant format).
    """
    e, cfg = spec.num_experts, ckpt.root / "config.json"
    for flag, v in (("--ep-size", ep_size), ("--tp-size", tp_size)):
        if v < 1:
            raise MoeshardError(f"{flag}: expected a positive integer, found {v}")
    if placement not in PLACEMENTS:
        raise MoeshardError(f"--placement {placement}: expected one of {', '.join(PLACEMENTS)}")
    if e % ep_size:
        valid = ", ".join(str(d) for d in range(1, e + 1) if e % d == 0)
        raise MoeshardError(
            f"{cfg}: {e} experts cannot be split evenly over --ep-size {ep_size} "
            f"(the trtllm-gen kernel needs the same number of experts on every rank); valid sizes: {valid}")
    pad_multiple = DEFAULT_PAD_MULTIPLE[spec.quant_format] if pad_multiple is None else pad_multiple
    if pad_multiple < 1:
        raise MoeshardError(f"--pad-multiple: expected a positive integer, found {pad_multiple}")
    sf = spec.quant_format.sf_vec_size
    h_pad = round_up(spec.hidden_size, pad_multiple)
    cuts = tp_slices(spec, tp_size) if tp_size <= spec.intermediate_size // sf else []
    if not cuts:
        raise MoeshardError(
            f"{cfg}: intermediate size {spec.intermediate_size} cannot be cut into --tp-size {tp_size} non-empty "
            f"slices of whole {sf}-element scale blocks; {_largest_valid_tp(spec, tp_size, h_pad, pad_multiple)}")
    i_pad = round_up(max(b - a for a, b in cuts), pad_multiple)
    try:
        check_kernel_shapes(h_pad, i_pad, sf, f"--pad-multiple {pad_multiple}, --tp-size {tp_size}")
    except MoeshardError as err:
        raise MoeshardError(f"{err}; {_largest_valid_tp(spec, tp_size, h_pad, pad_multiple)}"
                            if tp_size > 1 else str(err)) from None

    local = e // ep_size
    plan = Plan(ckpt.root, spec, ep_size, tp_size, placement, pad_multiple, h_pad, i_pad, epilogue_tile_m,
                (), (), tuple(f for f in COPIED_FILES if ckpt.file(f).is_file()))
    layer_bytes = [sum(t.nbytes for t in plan.layer_tensors(layer, local)) for layer in spec.moe_layers]
    packs = pack_groups(layer_bytes, max_shard_bytes)
    ranks = []
    for ep_rank in range(ep_size):
        experts = rank_experts(e, ep_size, tp_size, placement, ep_rank * tp_size)
        for tp_rank, (a, b) in enumerate(cuts):
            r = ep_rank * tp_size + tp_rank
            folder = f"rank-{r:05d}"
            files = tuple(OutFile(f"{folder}/{name}", tuple(spec.moe_layers[i] for i in pack), (),
                                  sum(layer_bytes[i] for i in pack))
                          for name, pack in zip(shard_names(len(packs)), packs))
            ranks.append(RankPlan(r, ep_rank, tp_rank, experts, a, b, files))

    common_names = sorted(n for n in ckpt.tensors if n not in spec.expert_tensors)
    cpacks = pack_groups([ckpt.tensors[n].nbytes for n in common_names], max_shard_bytes)
    common = tuple(OutFile(f"common/{name}", (), tuple(common_names[i] for i in pack),
                           sum(ckpt.tensors[common_names[i]].nbytes for i in pack))
                   for name, pack in zip(shard_names(len(cpacks)), cpacks))
    return dataclasses.replace(plan, ranks=tuple(ranks), common=common)
