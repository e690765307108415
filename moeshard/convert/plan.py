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
DEFAULT_PAD_MULTIPLE = 256


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
    rank: int
    ep_rank: int
    tp_rank: int
    experts: tuple[int, ...]
    files: tuple[OutFile, ...]

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


def make_plan(ckpt: Checkpoint, spec: ModelSpec, *, ep_size: int = 1, tp_size: int = 1,
              placement: str = "contiguous", pad_multiple: int = DEFAULT_PAD_MULTIPLE,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, epilogue_tile_m: int = EPILOGUE_TILE_M) -> Plan:
    """Plan the artifact of ``ckpt``; raises MoeshardError for splits or paddings the kernel cannot take."""
    e = spec.num_experts
    if ep_size < 1:
        raise MoeshardError(f"--ep-size: expected a positive integer, found {ep_size}")
    if tp_size != 1:
        raise MoeshardError(f"--tp-size {tp_size}: tensor-parallel shards are not supported yet; use --ep-size")
    if placement != "contiguous":
        raise MoeshardError(f"--placement {placement}: expected 'contiguous'")
    if e % ep_size:
        valid = ", ".join(str(d) for d in range(1, e + 1) if e % d == 0)
        raise MoeshardError(
            f"{ckpt.root / 'config.json'}: {e} experts cannot be split evenly over --ep-size {ep_size} "
            f"(the trtllm-gen kernel needs the same number of experts on every rank); valid sizes: {valid}")
    if pad_multiple < 1:
        raise MoeshardError(f"--pad-multiple: expected a positive integer, found {pad_multiple}")
    sf = spec.quant_format.sf_vec_size
    h_pad, i_pad = round_up(spec.hidden_size, pad_multiple), round_up(spec.intermediate_size, pad_multiple)
    check_kernel_shapes(h_pad, i_pad, sf, f"--pad-multiple {pad_multiple}")

    local = e // ep_size
    plan = Plan(ckpt.root, spec, ep_size, tp_size, placement, pad_multiple, h_pad, i_pad, epilogue_tile_m,
                (), (), tuple(f for f in COPIED_FILES if (ckpt.root / f).is_file()))
    layer_bytes = [sum(t.nbytes for t in plan.layer_tensors(layer, local)) for layer in spec.moe_layers]
    packs = pack_groups(layer_bytes, max_shard_bytes)
    ranks = []
    for r in range(ep_size):
        folder = f"rank-{r:05d}"
        files = tuple(OutFile(f"{folder}/{name}", tuple(spec.moe_layers[i] for i in pack), (),
                              sum(layer_bytes[i] for i in pack))
                      for name, pack in zip(shard_names(len(packs)), packs))
        ranks.append(RankPlan(r, r, 0, tuple(range(r * local, (r + 1) * local)), files))

    common_names = sorted(n for n in ckpt.tensors if n not in spec.expert_tensors)
    cpacks = pack_groups([ckpt.tensors[n].nbytes for n in common_names], max_shard_bytes)
    common = tuple(OutFile(f"common/{name}", (), tuple(common_names[i] for i in pack),
                           sum(ckpt.tensors[common_names[i]].nbytes for i in pack))
                   for name, pack in zip(shard_names(len(cpacks)), cpacks))
    return dataclasses.replace(plan, ranks=tuple(ranks), common=common)
