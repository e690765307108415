"""nvidia/Llama-4-Scout-17B-16E-Instruct-FP4 (ModelOpt NVFP4): experts fused across experts.

ModelOpt exports ``Llama4TextExperts`` in transformers' bmm layout ``[E, K, N]``: it quantizes
the ``[E, N, K]`` transpose (blocks along K, the input dim) and stores weight and block scale
transposed back, with one ``weight_scale_2`` and one ``input_scale`` for all experts. Gate is
the first half of the 2I axis, up the second (transformers ``gate_up.chunk(2, -1)``; vLLM
``chunk(2, dim=-2)`` after its transpose; TRT-LLM ``chunk(2, dim=0)``).
"""

from __future__ import annotations

import torch

from moeshard.checkpoints.families.base import AdapterBase, Family, ModelSpec, check_sizes, positive_ints
from moeshard.checkpoints.formats import QuantFormat
from moeshard.checkpoints.formats.modelopt import check_group_size, nvfp4_quant_algo, read_scalar
from moeshard.checkpoints.source import Checkpoint
from moeshard.errors import MoeshardError
from moeshard.layouts.kernel import ActivationType, RoutingMethod

PREFIX = "language_model.model.layers.{layer}.feed_forward.experts"
#: nvidia/Llama-4-Scout-17B-16E-Instruct-FP4, per MoE layer: leaf -> (dtype, shape(E, H, I)).
EXPERT_TENSORS = {
    "gate_up_proj": ("U8", lambda e, h, i: (e, h // 2, 2 * i)),  # [E, K/2, N], N = [gate ; up]
    "gate_up_proj_weight_scale": ("F8_E4M3", lambda e, h, i: (e, h // 16, 2 * i)),
    "gate_up_proj_weight_scale_2": ("F32", lambda e, h, i: ()),  # one for all experts
    "gate_up_proj_input_scale": ("F32", lambda e, h, i: ()),
    "down_proj": ("U8", lambda e, h, i: (e, i // 2, h)),
    "down_proj_weight_scale": ("F8_E4M3", lambda e, h, i: (e, i // 16, h)),
    "down_proj_weight_scale_2": ("F32", lambda e, h, i: ()),
    "down_proj_input_scale": ("F32", lambda e, h, i: ()),
}
ROUTER = {"weight": "language_model.model.layers.{layer}.feed_forward.router.weight"}


class Llama4Adapter(AdapterBase):
    family = Family.LLAMA4
    prefix = PREFIX
    router = ROUTER
    layers_key = "text_config.num_hidden_layers"
    experts_key = "text_config.num_local_experts"

    @staticmethod
    def moe_layers(config: dict) -> tuple[int, ...]:
        cfg = config.get("text_config") or {}
        step = cfg.get("interleave_moe_layer_step", 1)
        return tuple(cfg.get("moe_layers") or range(step - 1, cfg.get("num_hidden_layers", 0), step))

    def detect(self, config: dict, quant_config: dict | None) -> bool:
        return config.get("model_type") == "llama4" and nvfp4_quant_algo(config, quant_config) == "NVFP4"

    def spec(self, ckpt: Checkpoint) -> ModelSpec:
        where = ckpt.root / "config.json"
        check_sizes(self, ckpt.config, [*ckpt.tensors, *ckpt.absent], where)
        cfg = ckpt.config.get("text_config")
        if not isinstance(cfg, dict):
            raise MoeshardError(f"{where}: text_config: expected an object, found {type(cfg).__name__}")
        check_group_size(ckpt)
        positive_ints(cfg, f"{where}: text_config", ("num_local_experts", "hidden_size", "intermediate_size",
                                                      "num_hidden_layers", "num_experts_per_tok"))
        e, h, i = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
        if cfg["num_experts_per_tok"] != 1:
            raise MoeshardError(f"{where}: text_config.num_experts_per_tok: expected 1 (Llama-4 routing is top-1), "
                                f"found {cfg['num_experts_per_tok']}")
        layers = self.moe_layers(ckpt.config)
        names = set()
        why = f"from config.json text_config num_local_experts={e}, hidden_size={h}, intermediate_size={i}"
        for layer in layers:
            for leaf, (dtype, shape) in EXPERT_TENSORS.items():
                name = f"{PREFIX.format(layer=layer)}.{leaf}"
                ckpt.expect(name, dtype, shape(e, h, i), why, scalar_ok=True)
                names.add(name)
            ckpt.expect(ROUTER["weight"].format(layer=layer), "BF16", (e, h), why)
        return ModelSpec(
            family=self.family, quant_format=QuantFormat.NVFP4, num_experts=e, hidden_size=h, intermediate_size=i,
            moe_layers=layers, expert_prefix=PREFIX,
            routing={"routing_method_type": RoutingMethod.Llama4, "top_k": 1, "n_group": None, "topk_group": None,
                     "routed_scaling_factor": None, "apply_weight_on_input": True},
            activation={"type": "swiglu", "activation_type": ActivationType.Swiglu},
            router=dict(ROUTER), expert_tensors=frozenset(names))

    #: Canonical field -> its source tensor (for prefetching).
    sources = {"w13": ("gate_up_proj",), "w13_scale": ("gate_up_proj_weight_scale",), "w2": ("down_proj",),
               "w2_scale": ("down_proj_weight_scale",)}

    def read_raw(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, field: str, start: int, stop: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Experts ``[start, stop)`` of one canonical field: the fused bmm-layout tensor ``[n, K', N]``
        transposed to ``[n, N, K']`` (one copy); GEMM1's N is ``[gate ; up]``, so its row map
        swaps the halves into ``[up ; gate]``."""
        if field not in self.sources:
            return None  # no biases
        name = f"{spec.prefix(layer)}.{self.sources[field][0]}"
        t = ckpt.read(name, start, stop)
        if field.endswith("_scale"):
            t = ckpt.check_scales(name, t, True, start).view(torch.uint8)
        t = t.transpose(1, 2).contiguous()
        i = t.shape[1] // 2
        return t, (torch.cat((torch.arange(i, 2 * i), torch.arange(i))) if field.startswith("w13") else None)

    def read_scalars(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, start: int, stop: int
                     ) -> dict[str, torch.Tensor]:
        """``w1_scale_2``, ``w3_scale_2``, ``w2_scale_2``, ``w13_input_scale``, ``w2_input_scale``: ``[n]`` float32
        (one value per fused tensor, the same for all experts)."""
        p, n = spec.prefix(layer), stop - start
        a13, a2 = self.input_scales(ckpt, spec, layer)
        s13 = read_scalar(ckpt, f"{p}.gate_up_proj_weight_scale_2")
        values = {"w1_scale_2": s13, "w3_scale_2": s13,
                  "w2_scale_2": read_scalar(ckpt, f"{p}.down_proj_weight_scale_2"), "w13_input_scale": a13,
                  "w2_input_scale": a2}
        return {k: v.expand(n).clone() for k, v in values.items()}

    def input_scales(self, ckpt: Checkpoint, spec: ModelSpec, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a13, a2)``: one input_scale per fused expert tensor, shared by all experts."""
        p = spec.prefix(layer)
        return read_scalar(ckpt, f"{p}.gate_up_proj_input_scale"), read_scalar(ckpt, f"{p}.down_proj_input_scale")
