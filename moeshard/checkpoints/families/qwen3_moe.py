"""Qwen3-MoE in NVFP4 (``model_type: qwen3_moe``: nvidia/Qwen3-30B-A3B-FP4, Qwen3-235B-A22B-FP4,
and llm-compressor's NVFP4 exports).

One tensor per expert and projection (:mod:`.nvfp4_experts`), ``model.layers.N.mlp.experts.E.*``;
router ``mlp.gate.weight`` (unquantized); no shared expert. A layer is MoE unless it is in
``mlp_only_layers``, and when ``(layer + 1) % decoder_sparse_step == 0`` (transformers
``Qwen3MoeDecoderLayer``). Routing: softmax over all experts, top-k, renormalised when
``norm_topk_prob`` (transformers ``Qwen3MoeTopKRouter``): FlashInfer's RenormalizeNaive, as vLLM
picks it (``fused_moe/config.py::get_routing_method_type``); without renormalisation, Default.
"""

from __future__ import annotations

from moeshard.checkpoints.families.base import Family, ModelSpec, model_root, positive_ints
from moeshard.checkpoints.families.nvfp4_experts import PerExpertNvfp4
from moeshard.checkpoints.source import Checkpoint
from moeshard.errors import MoeshardError
from moeshard.layouts.kernel import ActivationType, RoutingMethod, routing_problems


class Qwen3MoeAdapter(PerExpertNvfp4):
    family = Family.QWEN3_MOE
    model_types = ("qwen3_moe",)
    layers_key = "num_hidden_layers"
    experts_key = "num_experts"

    def templates(self, config: dict, names) -> tuple[str, dict[str, str]]:
        root = model_root(names)
        return f"{root}.layers.{{layer}}.mlp.experts", {"weight": f"{root}.layers.{{layer}}.mlp.gate.weight"}

    def moe_layers(self, config: dict) -> tuple[int, ...]:
        cfg = self.text(config)
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
        return tuple(x for x in range(cfg["num_hidden_layers"]) if x not in dense and (x + 1) % step == 0)

    def spec(self, ckpt: Checkpoint) -> ModelSpec:
        config = ckpt.config
        where, names, scheme, cfg = self.read_config(ckpt)
        positive_ints(cfg, where, ("num_experts", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                                   "num_experts_per_tok"))
        e, h, i = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
        if h % 16 or i % 16:
            raise MoeshardError(f"{where}: hidden_size {h}, moe_intermediate_size {i}: expected multiples of 16")
        renorm = bool(cfg.get("norm_topk_prob", True))
        routing = {"routing_method_type": RoutingMethod.RenormalizeNaive if renorm else RoutingMethod.Default,
                   "top_k": cfg["num_experts_per_tok"], "n_group": None, "topk_group": None,
                   "routed_scaling_factor": None, "norm_topk_prob": renorm}
        if problems := routing_problems(routing, e):
            raise MoeshardError(f"{where}: the trtllm-gen kernel cannot route this model: {'; '.join(problems)}")
        prefix, router = self.templates(config, names)
        layers = tuple(x for x in self.moe_layers(config) if self.quantized_layer(scheme, prefix.format(layer=x)))
        if not layers:
            raise MoeshardError(f"{where}: no NVFP4 MoE layer (decoder_sparse_step, mlp_only_layers and what the quant "
                                "config quantized leave none)")
        expert_names = set()
        why = f"from config.json hidden_size={h}, moe_intermediate_size={i}"
        for layer in layers:
            expert_names |= self.expect_experts(ckpt, scheme.names, prefix.format(layer=layer), e, h, i, why)
            ckpt.expect(router["weight"].format(layer=layer), ("BF16", "F32"), (e, h),
                        f"from config.json num_experts={e}, hidden_size={h}")
        return ModelSpec(family=self.family, quant_format=scheme.format, num_experts=e, hidden_size=h,
                         intermediate_size=i, moe_layers=layers, expert_prefix=prefix, routing=routing,
                         activation={"type": "swiglu", "activation_type": ActivationType.Swiglu}, router=router,
                         expert_tensors=frozenset(expert_names), scheme=scheme, fused=False)
