"""What every checkpoint family shares: the closed enum of families, the model spec an adapter
produces, the adapter protocol, and the facts derived from it alone (config checks, expert-name
parsing, the tensors a rank needs, a rank's canonical experts for the reference path).

A family adapter knows the names and quirks of one checkpoint family and nothing of layouts: it
returns canonical fields (DESIGN.md, "Canonical experts").
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from moeshard.checkpoints.formats import QuantFormat, Scheme, detect_scheme
from moeshard.errors import MoeshardError

if TYPE_CHECKING:
    from pathlib import Path

    from torch import Tensor

    from moeshard.checkpoints.source import Checkpoint
    from moeshard.layouts.canonical import CanonicalExperts


class Family(str, enum.Enum):
    GPT_OSS = "gpt-oss"  # openai/gpt-oss (MXFP4)
    DEEPSEEK = "deepseek"  # DeepSeek-V3 architecture: DeepSeek-V3/R1, Kimi-K2 (NVFP4)
    QWEN3_MOE = "qwen3-moe"  # Qwen3-MoE (NVFP4)
    LLAMA4 = "llama4"  # Llama-4 Scout / Maverick (NVFP4)


@dataclass(frozen=True)
class ModelSpec:
    """What a converter needs to know of a checkpoint, from its config and headers.

    ``routing`` holds the trtllm-gen routing arguments (``routing_method_type``, ``top_k``,
    ``n_group``, ``topk_group``, ``routed_scaling_factor``); ``activation`` the activation
    (``type``, ``activation_type`` and its constants); ``expert_prefix`` is the module prefix
    template of a layer's experts, and ``router`` the names of the router tensors ({layer}
    placeholders).
    """

    family: Family
    quant_format: QuantFormat
    num_experts: int
    hidden_size: int
    intermediate_size: int
    moe_layers: tuple[int, ...]
    expert_prefix: str
    routing: dict
    activation: dict
    router: dict[str, str]
    expert_tensors: frozenset[str] = field(repr=False)
    has_bias: bool = False  # the experts have biases (w13_bias, w2_bias)
    scheme: Scheme | None = field(default=None, repr=False)  # exporter, tensor names, what is quantized
    fused: bool = True  # experts stored fused across experts (else one tensor per expert and projection)

    def prefix(self, layer: int) -> str:
        return self.expert_prefix.format(layer=layer)


class Adapter(Protocol):
    """One checkpoint family: names and quirks, nothing about layouts."""

    family: Family
    model_types: tuple[str, ...]  # config.json model_type (or text_config.model_type) values
    layers_key: str  # key of the layer count in the text config (:meth:`text`)
    experts_key: str  # key of the routed expert count in the text config

    def text(self, config: dict) -> dict:
        """The language model's config: config.json itself, or its ``text_config``."""

    def templates(self, config: dict, names: Iterable[str]) -> tuple[str, dict[str, str]]:
        """The expert module prefix template and the router tensor name templates ({layer}
        placeholders), given the checkpoint's tensor names (the root can be ``model`` or
        ``language_model.model``)."""

    def moe_layers(self, config: dict) -> tuple[int, ...]:
        """The MoE layers, from config.json alone (after :func:`check_sizes`)."""

    def accepts(self, scheme: Scheme) -> bool:
        """Whether this family converts checkpoints of ``scheme``."""

    def source_leaves(self, spec: ModelSpec, field: str) -> tuple[str, ...]:
        """The leaf names (under the expert prefix, after the expert number for per-expert
        storage) of the source tensors of canonical ``field`` (prefetching reads them ahead)."""

    def shared_leaves(self, spec: ModelSpec) -> tuple[str, ...]:
        """Leaves of per-expert tensors that every rank reads for all experts (NVFP4 input scales)."""

    def spec(self, ckpt: Checkpoint) -> ModelSpec:
        """Validate every expert tensor's header against the config; raise MoeshardError if off."""

    def read_raw(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, field: str, start: int, stop: int,
                 pin: bool = False) -> tuple[Tensor, Tensor | None] | None:
        """Experts ``[start, stop)`` of one canonical field (``w13``, ``w13_scale``, ``w2``,
        ``w2_scale``, ``w13_bias``, ``w2_bias``; see :class:`CanonicalExperts`), unpadded:
        ``(src, rows)`` where ``src[:, rows]`` (``src`` when rows is None) is the field, so that
        a checkpoint's own row order is read in place; None for a field the family lacks.
        Block scales are checked for NaN codes. With ``pin``, a ``src`` read for the field as it
        is (rows None, no conversion) is read into pinned memory."""

    def read_scalars(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, start: int, stop: int
                     ) -> dict[str, Tensor]:
        """NVFP4: ``w1_scale_2`` (gate), ``w3_scale_2`` (up), ``w2_scale_2``, ``w13_input_scale``,
        ``w2_input_scale`` ``[n]`` float32 of experts ``[start, stop)``; MXFP4: {}."""

    def input_scales(self, ckpt: Checkpoint, spec: ModelSpec, layer: int) -> tuple[Tensor, Tensor] | None:
        """NVFP4: ``(a13, a2)``, the layer's maxima of the GEMM1 / GEMM2 ``input_scale`` over all
        experts; MXFP4: None."""


class AdapterBase:
    """Defaults shared by the adapters: the text config is config.json itself, counts are read
    through the config keys, no per-expert scalars."""

    def text(self, config: dict) -> dict:
        return config

    def text_key(self, config: dict, key: str) -> str:
        """``key`` as it is spelled in config.json (``text_config.<key>`` when nested)."""
        return key if self.text(config) is config else f"text_config.{key}"

    def num_experts(self, config: dict) -> int:
        return self.text(config)[self.experts_key]

    def num_layers(self, config: dict) -> int:
        return self.text(config)[self.layers_key]

    def detect(self, config: dict) -> bool:
        """Whether config.json's model_type (or its text_config's) is one of this family's."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        return config.get("model_type") in self.model_types or text.get("model_type") in self.model_types

    def shared_leaves(self, spec) -> tuple[str, ...]:
        return ()

    def read_config(self, ckpt: Checkpoint) -> tuple[Path, list[str], Scheme, dict]:
        """What every ``spec`` starts from, after :func:`check_sizes`: config.json's path, every
        tensor name (fetched or not), the quantization scheme and the text config."""
        where, names = ckpt.root / "config.json", [*ckpt.tensors, *ckpt.absent]
        check_sizes(self, ckpt.config, names, where)
        return where, names, detect_scheme(ckpt.config, ckpt.quant_config, ckpt.root), self.text(ckpt.config)

    def read_scalars(self, ckpt, spec, layer, start, stop) -> dict:
        return {}

    def input_scales(self, ckpt, spec, layer):
        return None


def model_root(names: Iterable[str], roots: tuple[str, ...] = ("model", "language_model.model")) -> str:
    """The module root the checkpoint's decoder layers sit under: ModelOpt's Llama-4 exports use
    ``model.`` or ``language_model.model.`` (vLLM ``mllama4.py`` renames the one to the other),
    Kimi-K2.5 ``language_model.model.``."""
    for root in roots[::-1]:
        if any(n.startswith(f"{root}.layers.") for n in names):
            return root
    return roots[0]


# -- facts derived from the protocol ----------------------------------------------------------------
#: The most experts a trtllm-gen routing kernel takes (FlashInfer 0.7.2 routing: 2048 for
#: Renormalize, fewer for grouped DeepSeekV3); larger counts in a config are refused up front.
MAX_EXPERTS = 2048
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def positive_ints(cfg: dict, where, keys: tuple[str, ...]) -> None:
    for key in keys:
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool) or cfg[key] <= 0:
            raise MoeshardError(f"{where}: {key}: expected a positive integer, found {cfg.get(key)!r}")


def check_sizes(adapter: Adapter, config: dict, names: Iterable[str], where) -> None:
    """Refuse layer and expert counts that are not positive integers or exceed what the checkpoint's
    tensor names hold (or the kernel routes), before anything is built from them."""
    names = list(names)
    layers = 1 + max((int(m.group(1)) for n in names if (m := _LAYER.search(n))), default=-1)
    experts = 1 + max((int(m.group(1)) for n in names if (m := _EXPERT.search(n))), default=-1)
    text = adapter.text(config)
    if not isinstance(text, dict):
        raise MoeshardError(f"{where}: text_config: expected an object, found {type(text).__name__}")
    for key, limit, what in ((adapter.layers_key, layers, "the layers present in the checkpoint"),
                             (adapter.experts_key, min(experts or MAX_EXPERTS, MAX_EXPERTS),
                              "the experts present in the checkpoint" if experts else
                              "the most a trtllm-gen routing kernel takes")):
        v, spelled = text.get(key), adapter.text_key(config, key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise MoeshardError(f"{where}: {spelled}: expected a positive integer, found {v!r}")
        if v > limit:
            raise MoeshardError(f"{where}: {spelled}: expected at most {limit} ({what}), found {v}")


def expert_index(name: str, prefix: str) -> int | None:
    """The expert number of a per-expert tensor ``{prefix}.{e}.…`` (None for a tensor of the
    layer's fused experts). ``prefix`` ends without a dot."""
    head = name[len(prefix) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def needed_rows(adapter: Adapter, config: dict, names: Iterable[str], experts: set[int] | None, common: bool,
                layers: Iterable[int] | None = None, leaves: tuple[str, ...] = ("input_scale", "input_global_scale")
                ) -> dict[str, frozenset[int] | None]:
    """The tensors of ``names`` that a conversion of ``experts`` (all with None) reads, each with what
    of it is read: None for the whole tensor, or, for a tensor of a layer's fused experts, the
    experts whose rows (dim 0) are read (a fused tensor whose dim 0 is not the experts, a
    per-layer scalar, is read whole).

    - per-expert families: the chosen ``experts``' tensors, plus every expert's ``leaves``: the
      NVFP4 activation scales (ModelOpt ``input_scale``, compressed-tensors ``input_global_scale``),
      whose maxima over all experts of the layer every rank needs (whole, fused or not);
    - fused families: the chosen experts' rows of the fused tensors;
    - the routers (to validate the ranks), and, with ``common``, every non-expert tensor.

    ``layers`` restricts the expert tensors and routers to those MoE layers (default: all).
    """
    names = list(names)
    template, router = adapter.templates(config, names)
    moe = adapter.moe_layers(config)
    chosen_layers = [x for x in moe if layers is None or x in set(layers)]
    prefixes = {template.format(layer=layer) for layer in chosen_layers}
    other = {template.format(layer=layer) for layer in moe} - prefixes
    routers = {t.format(layer=layer) for layer in chosen_layers for t in router.values()}
    shared = tuple("." + x for x in leaves)
    chosen = None if experts is None else frozenset(experts)
    out: dict[str, frozenset[int] | None] = {}
    for name in names:
        prefix = next((p for p in prefixes if name.startswith(p + ".")), None)
        if prefix is None:
            if name in routers or (common and not any(name.startswith(p + ".") for p in other)):
                out[name] = None
            continue
        e = expert_index(name, prefix)
        if chosen is None or name.endswith(shared) or (e is not None and e in chosen):
            out[name] = None
        elif e is None:
            out[name] = chosen
    return out


def needed_tensors(adapter: Adapter, config: dict, names: Iterable[str], experts: set[int] | None,
                   common: bool) -> set[str]:
    """The tensor names of ``names`` a (rank-only) conversion reads (:func:`needed_rows`, whole or
    in part)."""
    return set(needed_rows(adapter, config, names, experts, common))


#: The canonical fields that are tensors of rows (the rest are per-expert scalars).
ROW_FIELDS = ("w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias")


def read_experts(adapter: Adapter, ckpt: Checkpoint, spec: ModelSpec, layer: int, start: int,
                 stop: int, pin: bool = False) -> CanonicalExperts:
    """Experts ``[start, stop)`` of one layer in canonical form, unpadded; the tensors of rows in
    pinned memory with ``pin`` (read there, or gathered there from the checkpoint's row order)."""
    import torch

    from moeshard.layouts.canonical import CanonicalExperts

    fields = {}
    for f in ROW_FIELDS:
        if (got := adapter.read_raw(ckpt, spec, layer, f, start, stop, pin)) is not None:
            src, rows = got
            if rows is not None:
                out = torch.empty((src.shape[0], len(rows), *src.shape[2:]), dtype=src.dtype, pin_memory=pin)
                src = torch.index_select(src, 1, rows, out=out)
            fields[f] = src if not pin or src.is_pinned() else src.pin_memory()
    return CanonicalExperts(**fields, **adapter.read_scalars(ckpt, spec, layer, start, stop))


def expert_runs(experts: Iterable[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive expert ids, in order: ``[(start, stop), ...]``."""
    runs: list[list[int]] = []
    for x in experts:
        if runs and runs[-1][1] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, x + 1])
    return [(a, b) for a, b in runs]


def read_rank_experts(adapter: Adapter, ckpt: Checkpoint, spec: ModelSpec, layer: int, experts,
                      i_start: int, i_stop: int, tp_rank: int) -> CanonicalExperts:
    """One rank's canonical experts of one layer, unpadded: its experts (one read per run of
    consecutive experts), its TP slice of the intermediate dimension, and the down-projection
    bias only on TP rank 0 (zeros elsewhere, as vLLM loads it: the row-parallel outputs are
    summed). The reference path (validate); convert reads the same in place."""
    import torch

    from moeshard.layouts.canonical import concat_experts, slice_intermediate

    c = concat_experts([read_experts(adapter, ckpt, spec, layer, a, b) for a, b in expert_runs(experts)])
    if (i_start, i_stop) != (0, spec.intermediate_size):
        c = slice_intermediate(c, i_start, i_stop)
    if tp_rank > 0 and c.w2_bias is not None:
        c = c.replace(w2_bias=torch.zeros_like(c.w2_bias))
    return c
