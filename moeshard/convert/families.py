"""Checkpoint families: a closed enum, the adapter protocol, and the model spec they produce."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
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

    def read_experts(self, ckpt: "Checkpoint", spec: ModelSpec, layer: int, start: int, stop: int) -> "CanonicalExperts":
        """Experts ``[start, stop)`` of one layer in canonical form, unpadded."""

    # NVFP4 families also have:
    # def input_scales(self, ckpt, spec, layer) -> tuple[Tensor, Tensor]:
    #     """(a13, a2): the layer's maxima of the GEMM1 / GEMM2 input_scale over all experts."""


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
