"""openai/gpt-oss-20b and -120b (MXFP4 experts, everything else BF16)."""

from __future__ import annotations

import torch

from moeshard.checkpoints.families.base import AdapterBase, Family, ModelSpec
from moeshard.checkpoints.formats import QuantFormat, Scheme
from moeshard.checkpoints.source import Checkpoint
from moeshard.errors import MoeshardError
from moeshard.layouts.kernel import ActivationType, RoutingMethod

PREFIX = "model.layers.{layer}.mlp.experts"
#: Expert tensors of one layer: name -> (dtype code, shape as a function of E, H, I).
#: openai/gpt-oss-{20b,120b} model-0000k-of-0000K.safetensors (transformers' Mxfp4GptOssExperts).
EXPERT_TENSORS = {
    "gate_up_proj_blocks": ("U8", lambda e, h, i: (e, 2 * i, h // 32, 16)),  # gate/up rows interleaved
    "gate_up_proj_scales": ("U8", lambda e, h, i: (e, 2 * i, h // 32)),  # UE8M0
    "gate_up_proj_bias": ("BF16", lambda e, h, i: (e, 2 * i)),
    "down_proj_blocks": ("U8", lambda e, h, i: (e, h, i // 32, 16)),
    "down_proj_scales": ("U8", lambda e, h, i: (e, h, i // 32)),
    "down_proj_bias": ("BF16", lambda e, h, i: (e, h)),
}
ROUTER = {"weight": "model.layers.{layer}.mlp.router.weight", "bias": "model.layers.{layer}.mlp.router.bias"}
#: GPT-OSS's clamped SwiGLU: alpha and beta are hard-coded in the reference code (not in
#: config.json); the clamp limit is config.json's ``swiglu_limit``.
SWIGLU_ALPHA = 1.702
SWIGLU_BETA = 1.0


def _deinterleaved_rows(two_i: int) -> torch.Tensor:
    """Source row of each canonical ``[up ; gate]`` row: the source interleaves ``[g0, u0, g1, u1, ...]``."""
    return torch.cat((torch.arange(1, two_i, 2), torch.arange(0, two_i, 2)))


class GptOssAdapter(AdapterBase):
    family = Family.GPT_OSS
    model_types = ("gpt_oss",)
    layers_key = "num_hidden_layers"
    experts_key = "num_local_experts"

    def templates(self, config: dict, names) -> tuple[str, dict[str, str]]:
        return PREFIX, dict(ROUTER)

    def moe_layers(self, config: dict) -> tuple[int, ...]:
        return tuple(range(config["num_hidden_layers"]))  # every gpt-oss layer is MoE

    def accepts(self, scheme: Scheme) -> bool:
        return scheme.exporter == "openai"

    def spec(self, ckpt: Checkpoint) -> ModelSpec:
        where, _, scheme, cfg = self.read_config(ckpt)
        if not self.accepts(scheme):
            raise MoeshardError(f"{where}: gpt_oss in {scheme.exporter} {scheme.format.value}: expected the MXFP4 "
                                "release (quantization_config.quant_method 'mxfp4')")
        for key in ("num_local_experts", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise MoeshardError(f"{where}: {key}: expected a positive integer, found {cfg.get(key)!r}")
        e, h, i = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
        top_k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
        if h % 32 or i % 32:
            raise MoeshardError(f"{where}: hidden_size {h} and intermediate_size {i}: expected multiples of 32 "
                                "(MXFP4 block)")
        if not isinstance(top_k, int) or not 1 <= top_k <= e:
            raise MoeshardError(f"{where}: num_experts_per_tok: expected an integer in 1..{e}, found {top_k!r}")
        layers = self.moe_layers(cfg)
        why = f"from config.json num_local_experts={e}, hidden_size={h}, intermediate_size={i}"
        names = set()
        for layer in layers:
            for leaf, (dtype, shape) in EXPERT_TENSORS.items():
                name = f"{PREFIX.format(layer=layer)}.{leaf}"
                ckpt.expect(name, dtype, shape(e, h, i), why)
                names.add(name)
            ckpt.expect(ROUTER["weight"].format(layer=layer), ("BF16", "F32"), (e, h), why)
        return ModelSpec(
            family=self.family,
            quant_format=QuantFormat.MXFP4,
            num_experts=e,
            hidden_size=h,
            intermediate_size=i,
            moe_layers=layers,
            expert_prefix=PREFIX,
            routing={"routing_method_type": RoutingMethod.Renormalize, "top_k": top_k, "n_group": None,
                     "topk_group": None, "routed_scaling_factor": None},
            activation={"type": "swiglu_oai", "activation_type": ActivationType.Swiglu, "alpha": SWIGLU_ALPHA,
                        "beta": SWIGLU_BETA, "limit": float(cfg.get("swiglu_limit", 7.0))},
            router=dict(ROUTER),
            expert_tensors=frozenset(names),
            has_bias=True,
            scheme=scheme,
        )

    #: Canonical field -> its source tensor.
    SOURCES = {"w13": "gate_up_proj_blocks", "w13_scale": "gate_up_proj_scales", "w13_bias": "gate_up_proj_bias",
               "w2": "down_proj_blocks", "w2_scale": "down_proj_scales", "w2_bias": "down_proj_bias"}

    def source_leaves(self, spec: ModelSpec, field: str) -> tuple[str, ...]:
        return (self.SOURCES[field],)

    def read_raw(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, field: str, start: int, stop: int,
                 pin: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Experts ``[start, stop)`` of one canonical field, read in place (no copy): the fused
        tensor's rows, with the row map that de-interleaves gate and up."""
        name = f"{spec.prefix(layer)}.{self.SOURCES[field]}"
        gated, bias = field.startswith("w13"), field.endswith("bias")
        t = ckpt.read(name, start, stop, pin=pin and not (gated or bias))  # pinned only if returned as read
        if field.endswith("_scale"):
            ckpt.check_scales(name, t, False, start)
        t = t.float() if bias else t.flatten(-2) if t.dim() == 4 else t  # blocks: [n, rows, H/2]
        return t, (_deinterleaved_rows(t.shape[1]) if gated else None)

