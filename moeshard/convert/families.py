"""Checkpoint families: a closed enum, the adapter protocol, and the model spec they produce."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from moeshard.errors import MoeshardError

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
    layers_key: str  # config.json key of the layer count ("a.b": nested)
    experts_key: str  # config.json key of the routed expert count

    def moe_layers(self, config: dict) -> tuple[int, ...]:
        """The MoE layers, from config.json alone (rank-only downloads plan with it)."""

    def num_experts(self, config: dict) -> int:
        """The routed expert count, from config.json alone."""

    def detect(self, config: dict, quant_config: dict | None) -> bool:
        """Whether config.json (and hf_quant_config.json) describe this family."""

    def spec(self, ckpt: Checkpoint) -> ModelSpec:
        """Validate every expert tensor's header against the config; raise MoeshardError if off."""

    sources: dict[str, tuple[str, ...]]
    """Canonical field -> the leaf names of its source tensors (prefetching reads them ahead)."""

    def read_raw(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, field: str, start: int, stop: int
                 ) -> tuple[Tensor, Tensor | None] | None:
        """Experts ``[start, stop)`` of one canonical field (``w13``, ``w13_scale``, ``w2``,
        ``w2_scale``, ``w13_bias``, ``w2_bias``; see :class:`CanonicalExperts`), unpadded:
        ``(src, rows)`` where ``src[:, rows]`` (``src`` when rows is None) is the field, so that
        a checkpoint's own row order is read in place; None for a field the family lacks.
        Block scales are checked for NaN codes."""

    def read_scalars(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, start: int, stop: int
                     ) -> dict[str, Tensor]:
        """NVFP4: ``w13_scale_2``, ``w2_scale_2``, ``w13_input_scale``, ``w2_input_scale``
        ``[n]`` float32 of experts ``[start, stop)``; MXFP4: {}."""

    # NVFP4 families also have:
    # def input_scales(self, ckpt, spec, layer) -> tuple[Tensor, Tensor]:
    #     """(a13, a2): the layer's maxima of the GEMM1 / GEMM2 input_scale over all experts."""


#: The canonical fields that are tensors of rows (the rest are per-expert scalars).
ROW_FIELDS = ("w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias")


def read_experts(adapter: Adapter, ckpt: Checkpoint, spec: ModelSpec, layer: int, start: int,
                 stop: int) -> CanonicalExperts:
    """Experts ``[start, stop)`` of one layer in canonical form, unpadded."""
    from moeshard.layouts.canonical import CanonicalExperts

    fields = {}
    for f in ROW_FIELDS:
        if (got := adapter.read_raw(ckpt, spec, layer, f, start, stop)) is not None:
            src, rows = got
            fields[f] = src if rows is None else src.index_select(1, rows)
    return CanonicalExperts(**fields, **adapter.read_scalars(ckpt, spec, layer, start, stop))


#: The most experts a trtllm-gen routing kernel takes (FlashInfer 0.7.2 routing: 2048 for
#: Renormalize, fewer for grouped DeepSeekV3); larger counts in a config are refused up front.
MAX_EXPERTS = 2048
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def config_value(config: dict, key: str):
    """``config["a"]["b"]`` for ``key`` "a.b" (None where missing)."""
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def check_sizes(adapter: Adapter, config: dict, names, where) -> None:
    """Refuse layer and expert counts that are not positive integers or exceed what the checkpoint's
    tensor names hold (or the kernel routes), before anything is built from them."""
    names = list(names)
    layers = 1 + max((int(m.group(1)) for n in names if (m := _LAYER.search(n))), default=-1)
    experts = 1 + max((int(m.group(1)) for n in names if (m := _EXPERT.search(n))), default=-1)
    for key, limit, what in ((adapter.layers_key, layers, "the layers present in the checkpoint"),
                             (adapter.experts_key, min(experts or MAX_EXPERTS, MAX_EXPERTS),
                              "the experts present in the checkpoint" if experts else
                              "the most a trtllm-gen routing kernel takes")):
        v = config_value(config, key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise MoeshardError(f"{where}: {key}: expected a positive integer, found {v!r}")
        if v > limit:
            raise MoeshardError(f"{where}: {key}: expected at most {limit} ({what}), found {v}")


def adapters() -> dict[Family, Adapter]:
    from moeshard.convert.deepseek import DeepSeekAdapter
    from moeshard.convert.gpt_oss import GptOssAdapter
    from moeshard.convert.llama4 import Llama4Adapter

    return {Family.GPT_OSS: GptOssAdapter(), Family.DEEPSEEK: DeepSeekAdapter(), Family.LLAMA4: Llama4Adapter()}


def detect(ckpt: Checkpoint) -> Adapter:
    """The adapter whose family matches the checkpoint's config, or a MoeshardError."""
    return detect_config(ckpt.config, ckpt.quant_config, ckpt.root / "config.json")


def detect_config(config: dict, quant_config: dict | None, where) -> Adapter:
    for adapter in adapters().values():
        if adapter.detect(config, quant_config):
            return adapter
    mt = config.get("model_type")
    qm = (config.get("quantization_config") or {}).get("quant_method")
    raise MoeshardError(
        f"{where}: unsupported checkpoint: expected gpt_oss (mxfp4), deepseek_v3 or llama4 "
        f"(ModelOpt NVFP4), found model_type {mt!r} with quant_method {qm!r}"
    )
