"""Plan a conversion from headers alone: which ranks own which experts, which output file holds
which tensors, with every shape and dtype known before a weight byte is read. The plan is frozen
and carries every option of the run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from moeshard.checkpoints.families import ModelSpec
from moeshard.checkpoints.formats import QuantFormat
from moeshard.checkpoints.safetensors_io import GB, pack_groups, shard_names, tensor_bytes
from moeshard.checkpoints.source import Checkpoint
from moeshard.errors import MoeshardError
from moeshard.layouts.fingerprint import layout_fingerprint
from moeshard.layouts.kernel import (
    BIASES,
    HIDDEN_PADDINGS,
    KERNEL_FIELDS,
    NVFP4,
    SWIGLU_OAI,
    WEIGHTS,
    gemm2_rows,
    kernel_shape_problems,
    kernel_tensors,
)
from moeshard.layouts.tp import tp_slices
from moeshard.layouts.trtllm import EPILOGUE_TILE_M

#: Non-tensor files copied unchanged from the source into the artifact.
COPIED_FILES = ("config.json", "generation_config.json", "hf_quant_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
DEFAULT_MAX_SHARD_BYTES = 5 * GB
#: Output bytes transformed per step: bounds memory whatever the layer or model size.
CHUNK_BYTES = 64 << 20
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
class Options:
    """Every option of a conversion (the CLI's flags), checked by :func:`make_plan`.

    ``pad_multiple`` None: the format's default; ``hidden_padding``: GEMM2's rows, one of
    :data:`~moeshard.layouts.kernel.HIDDEN_PADDINGS`; ``ranks`` None: all ranks; ``common``: write
    ``common/``; ``device``: where the gathers run; ``chunk_bytes``: output bytes per step.
    """

    ep_size: int = 1
    tp_size: int = 1
    placement: str = "contiguous"
    pad_multiple: int | None = None
    hidden_padding: str = "vllm"
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    ranks: tuple[int, ...] | None = None
    common: bool = True
    device: str = "cpu"
    chunk_bytes: int = CHUNK_BYTES
    overwrite: bool = False
    resume: bool = False


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: its name (module prefix + FlashInfer argument name), dtype code, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.dtype, self.shape)


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
    """The artifact to write: every rank of the sharding (``ranks``), the ones this run writes
    (:attr:`chosen`), ``common/``'s files and the copied files, with the run's ``options``;
    ``gemm2_rows``: GEMM2's rows (:func:`~moeshard.layouts.kernel.gemm2_rows`); ``fingerprint``:
    the layout fingerprint of its kernel tensors (:mod:`moeshard.layouts.fingerprint`)."""

    source: Path
    spec: ModelSpec
    options: Options
    pad_multiple: int
    hidden_size_padded: int
    intermediate_size_padded: int
    gemm2_rows: int
    epilogue_tile_m: int
    fingerprint: dict[str, str]
    ranks: tuple[RankPlan, ...]
    common: tuple[OutFile, ...]
    copied: tuple[str, ...]

    @property
    def chosen(self) -> list[RankPlan]:
        """The ranks this run writes (``options.ranks``, default all)."""
        want = self.options.ranks
        return list(self.ranks) if want is None else [r for r in self.ranks if r.rank in set(want)]

    @property
    def tensor_groups(self) -> frozenset[str]:
        """Which kernel tensors a layer has (:data:`moeshard.layouts.kernel.KERNEL_TENSORS`)."""
        spec = self.spec
        return frozenset({WEIGHTS} | ({BIASES} if spec.has_bias else set())
                         | ({SWIGLU_OAI} if spec.activation["type"] == "swiglu_oai" else set())
                         | ({NVFP4} if spec.quant_format is QuantFormat.NVFP4 else set()))

    def layer_tensors(self, layer: int, local_experts: int) -> list[OutTensor]:
        """The tensors one rank file holds for one MoE layer (DESIGN.md, "The artifact")."""
        e, h, n2, i = local_experts, self.hidden_size_padded, self.gemm2_rows, self.intermediate_size_padded
        sf, p = self.spec.quant_format.sf_vec_size, self.spec.prefix(layer)
        return [OutTensor(f"{p}.{t.name}", t.dtype, t.shape(e, h, n2, i, sf))
                for t in kernel_tensors(self.tensor_groups)]

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for r in self.ranks for f in r.files) + sum(f.nbytes for f in self.common)

    @property
    def bytes_to_write(self) -> int:
        """Bytes of the chosen ranks' files and (with ``options.common``) common/."""
        return (sum(f.nbytes for r in self.chosen for f in r.files)
                + (sum(f.nbytes for f in self.common) if self.options.common else 0))

    def to_json(self) -> dict:
        """What ``convert --dry-run --json`` prints: per rank its experts, slice and files."""
        return {"ranks": [{"rank": r.rank, "ep_rank": r.ep_rank, "tp_rank": r.tp_rank, "experts": list(r.experts),
                           "intermediate_slice": [r.i_start, r.i_stop],
                           "files": [{"path": f.path, "layers": list(f.layers), "bytes": f.nbytes} for f in r.files]}
                          for r in self.ranks],
                "common_files": [{"path": f.path, "tensors": len(f.sources), "bytes": f.nbytes} for f in self.common],
                "hidden_size_padded": self.hidden_size_padded, "gemm2_rows": self.gemm2_rows,
                "intermediate_size_padded": self.intermediate_size_padded, "bytes": self.total_bytes}


def rank_experts(num_experts: int, ep_size: int, tp_size: int, placement: str, rank: int) -> tuple[int, ...]:
    """The experts of output rank ``rank`` (= ep_rank * tp_size + tp_rank)."""
    ep_rank, local = rank // tp_size, num_experts // ep_size
    if placement == "contiguous":
        return tuple(range(ep_rank * local, (ep_rank + 1) * local))
    return tuple(range(ep_rank, num_experts, ep_size))


def _cuts(spec: ModelSpec, tp_size: int) -> list[tuple[int, int]]:
    fmt = spec.quant_format
    return tp_slices(spec.intermediate_size, fmt.sf_vec_size, tp_size, ceil_blocks=fmt is QuantFormat.MXFP4)


def _largest_valid_tp(spec: ModelSpec, tp_size: int, h_pad: int, pad_multiple: int) -> str:
    """'largest valid --tp-size: T' (T <= tp_size), or that none works with this padding. No T above
    I / sf can give every rank a whole scale block, so at most I / sf sizes are tried."""
    sf = spec.quant_format.sf_vec_size
    for t in range(min(tp_size, spec.intermediate_size // sf), 0, -1):
        cuts = _cuts(spec, t)
        if cuts and not kernel_shape_problems(h_pad, round_up(max(b - a for a, b in cuts), pad_multiple), sf):
            return f"largest valid --tp-size: {t}"
    return f"no --tp-size works with --pad-multiple {pad_multiple}"


def make_plan(ckpt: Checkpoint, spec: ModelSpec, options: Options, epilogue_tile_m: int = EPILOGUE_TILE_M) -> Plan:
    """Plan the artifact of ``ckpt``; raises MoeshardError for splits or paddings the kernel cannot
    take, and for ``options.ranks`` the sharding does not have.

    Rank ``ep_rank * tp_size + tp_rank`` owns EP group ``ep_rank``'s experts (contiguous:
    ``[r*E/ep, (r+1)*E/ep)``; round-robin: ``e % ep == r``) and TP slice ``tp_rank`` of each.
    H and the per-rank I are zero-padded to ``pad_multiple`` (default: per quant format); GEMM2
    gets :func:`~moeshard.layouts.kernel.gemm2_rows` rows for ``options.hidden_padding``. Refuses a
    FlashInfer whose layout differs from moeshard's (:func:`layout_fingerprint`).
    """
    o = options
    e, cfg = spec.num_experts, ckpt.root / "config.json"
    for flag, v in (("--ep-size", o.ep_size), ("--tp-size", o.tp_size)):
        if v < 1:
            raise MoeshardError(f"{flag}: expected a positive integer, found {v}")
    if o.placement not in PLACEMENTS:
        raise MoeshardError(f"--placement {o.placement}: expected one of {', '.join(PLACEMENTS)}")
    if o.hidden_padding not in HIDDEN_PADDINGS:
        raise MoeshardError(f"--hidden-padding {o.hidden_padding}: expected one of {', '.join(HIDDEN_PADDINGS)}")
    if e % o.ep_size:
        valid = ", ".join(str(d) for d in range(1, e + 1) if e % d == 0)
        raise MoeshardError(
            f"{cfg}: {e} experts cannot be split evenly over --ep-size {o.ep_size} "
            f"(the trtllm-gen kernel needs the same number of experts on every rank); valid sizes: {valid}")
    pad_multiple = DEFAULT_PAD_MULTIPLE[spec.quant_format] if o.pad_multiple is None else o.pad_multiple
    if pad_multiple < 1:
        raise MoeshardError(f"--pad-multiple: expected a positive integer, found {pad_multiple}")
    sf = spec.quant_format.sf_vec_size
    h_pad = round_up(spec.hidden_size, pad_multiple)
    cuts = _cuts(spec, o.tp_size)
    if not cuts:
        raise MoeshardError(
            f"{cfg}: intermediate size {spec.intermediate_size} cannot be cut into --tp-size {o.tp_size} non-empty "
            f"slices of whole {sf}-element scale blocks; {_largest_valid_tp(spec, o.tp_size, h_pad, pad_multiple)}")
    i_pad = round_up(max(b - a for a, b in cuts), pad_multiple)
    if problems := kernel_shape_problems(h_pad, i_pad, sf):
        raise MoeshardError(f"--pad-multiple {pad_multiple}, --tp-size {o.tp_size}: {'; '.join(problems)}"
                            + (f"; {_largest_valid_tp(spec, o.tp_size, h_pad, pad_multiple)}" if o.tp_size > 1 else ""))

    local = e // o.ep_size
    n2 = gemm2_rows(spec.hidden_size, h_pad, o.hidden_padding)
    plan = Plan(ckpt.root, spec, o, pad_multiple, h_pad, i_pad, n2, epilogue_tile_m, {},
                (), (), tuple(f for f in COPIED_FILES if ckpt.file(f).is_file()))
    kinds = [t.name for t in kernel_tensors(plan.tensor_groups) if t.name in KERNEL_FIELDS]
    fingerprint = layout_fingerprint(kinds, h_pad, n2, i_pad, sf, epilogue_tile_m, check_moeshard=True)
    layer_bytes = [sum(t.nbytes for t in plan.layer_tensors(layer, local)) for layer in spec.moe_layers]
    packs = pack_groups(layer_bytes, o.max_shard_bytes)
    ranks = []
    for ep_rank in range(o.ep_size):
        experts = rank_experts(e, o.ep_size, o.tp_size, o.placement, ep_rank * o.tp_size)
        for tp_rank, (a, b) in enumerate(cuts):
            r = ep_rank * o.tp_size + tp_rank
            folder = f"rank-{r:05d}"
            files = tuple(OutFile(f"{folder}/{name}", tuple(spec.moe_layers[i] for i in pack), (),
                                  sum(layer_bytes[i] for i in pack))
                          for name, pack in zip(shard_names(len(packs)), packs))
            ranks.append(RankPlan(r, ep_rank, tp_rank, experts, a, b, files))
    if o.ranks is not None and not set(o.ranks) <= {r.rank for r in ranks}:
        raise MoeshardError(f"--ranks {','.join(map(str, o.ranks))}: the sharding has ranks 0..{len(ranks) - 1}")

    common_names = sorted(n for n in ckpt.tensors if n not in spec.expert_tensors)
    cpacks = pack_groups([ckpt.tensors[n].nbytes for n in common_names], o.max_shard_bytes)
    common = tuple(OutFile(f"common/{name}", (), tuple(common_names[i] for i in pack),
                           sum(ckpt.tensors[common_names[i]].nbytes for i in pack))
                   for name, pack in zip(shard_names(len(cpacks)), cpacks))
    return dataclasses.replace(plan, fingerprint=fingerprint, ranks=tuple(ranks), common=common)
