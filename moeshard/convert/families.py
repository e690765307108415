"""Checkpoint families: a closed enum, the adapter protocol, and the model spec they produce."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor

    from moeshard.convert.source import Checkpoint
    from moeshard.layouts.canonical import CanonicalExperts


class Family(str, enum.Enum):
    GPT_OSS = "gpt-oss"
    DEEPSEEK = "deepseek"
    LLAMA4 = "llama4"


class QuantFormat(str, enum.Enum):
    MXFP4 = "mxfp4"
    NVFP4 = "nvfp4"

    @property
    def sf_vec_size(self) -> int:
        return 32 if self is QuantFormat.MXFP4 else 16


@dataclass(frozen=True)
class ModelSpec:
    """What a converter needs to know of a checkpoint, from its config and headers.

    ``routing`` holds the trtllm-gen routing arguments (``routing_method_type``, ``top_k``,
    ``n_group``, ``topk_group``, ``routed_scaling_factor``); ``activation`` the SwiGLU
    constants; ``expert_prefix`` is the module prefix template of a layer's experts, and
    ``router`` the names of the router tensors ({layer} placeholders).
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

    def prefix(self, layer: int) -> str:
        return self.expert_prefix.format(layer=layer)


class Adapter(Protocol):
    """One checkpoint family: names and quirks, nothing about layouts."""

    family: Family
    prefix: str  # expert module prefix template, "{layer}" placeholder

    def moe_layers(self, config: dict) -> tuple[int, ...]:
        """The MoE layers, from config.json alone (rank-only downloads plan with it)."""

    def num_experts(self, config: dict) -> int:
        """The routed expert count, from config.json alone."""

    def detect(self, config: dict, quant_config: dict | None) -> bool:
        """Whether config.json (and hf_quant_config.json) describe this family."""

    def spec(self, ckpt: "Checkpoint") -> ModelSpec:
        """Validate every expert tensor's header against the config; raise MoeshardError if off."""

    sources: dict[str, tuple[str, ...]]
    """Canonical field -> the leaf names of its source tensors (prefetching reads them ahead)."""

    def read_raw(self, ckpt: "Checkpoint", spec: ModelSpec, layer: int, field: str, start: int, stop: int
                 ) -> "tuple[Tensor, Tensor | None] | None":
        """Experts ``[start, stop)`` of one canonical field (``w13``, ``w13_scale``, ``w2``,
        ``w2_scale``, ``w13_bias``, ``w2_bias``; see :class:`CanonicalExperts`), unpadded:
        ``(src, rows)`` where ``src[:, rows]`` (``src`` when rows is None) is the field, so that
        a checkpoint's own row order is read in place; None for a field the family lacks.
        Block scales are checked for NaN codes."""

    def read_scalars(self, ckpt: "Checkpoint", spec: ModelSpec, layer: int, start: int, stop: int
                     ) -> "dict[str, Tensor]":
        """NVFP4: ``w13_scale_2``, ``w2_scale_2``, ``w13_input_scale``, ``w2_input_scale``
        ``[n]`` float32 of experts ``[start, stop)``; MXFP4: {}."""

    # NVFP4 families also have:
    # def input_scales(self, ckpt, spec, layer) -> tuple[Tensor, Tensor]:
    #     """(a13, a2): the layer's maxima of the GEMM1 / GEMM2 input_scale over all experts."""


#: The canonical fields that are tensors of rows (the rest are per-expert scalars).
ROW_FIELDS = ("w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias")


def read_experts(adapter: Adapter, ckpt: "Checkpoint", spec: ModelSpec, layer: int, start: int,
                 stop: int) -> "CanonicalExperts":
    """Experts ``[start, stop)`` of one layer in canonical form, unpadded."""
    from moeshard.layouts.canonical import CanonicalExperts

    fields = {}
    for f in ROW_FIELDS:
        if (got := adapter.read_raw(ckpt, spec, layer, f, start, stop)) is not None:
            src, rows = got
            fields[f] = src if rows is None else src.index_select(1, rows)
    return CanonicalExperts(**fields, **adapter.read_scalars(ckpt, spec, layer, start, stop))


def adapters() -> dict[Family, Adapter]:
    from moeshard.convert.deepseek import DeepSeekAdapter
    from moeshard.convert.gpt_oss import GptOssAdapter
    from moeshard.convert.llama4 import Llama4Adapter

    return {Family.GPT_OSS: GptOssAdapter(), Family.DEEPSEEK: DeepSeekAdapter(), Family.LLAMA4: Llama4Adapter()}


def detect(ckpt: "Checkpoint") -> Adapter:
    """The adapter whose family matches the checkpoint's config, or a MoeshardError."""
    return detect_config(ckpt.config, ckpt.quant_config, ckpt.root / "config.json")


def detect_config(config: dict, quant_config: dict | None, where) -> Adapter:
    from moeshard.errors import MoeshardError

    for adapter in adapters().values():
        if adapter.detect(config, quant_config):
            return adapter
    mt = config.get("model_type")
    qm = (config.get("quantization_config") or {}).get("quant_method")
    raise MoeshardError(
        f"{where}: unsupported checkpoint: expected gpt_oss (mxfp4), deepseek_v3 or llama4 "
        f"(ModelOpt NVFP4), found model_type {mt!r} with quant_method {qm!r}"
    )
