"""The DeepSeek-V3 architecture in NVFP4: DeepSeek-V3 / V3-0324 / V3.1 / R1 / R1-0528
(``model_type: deepseek_v3``), Kimi-K2 (``kimi_k2``: 384 experts, one group) and Kimi-K2.5
(``kimi_k25``: the text model under ``text_config``, tensors under ``language_model.model.``),
from ModelOpt (nvidia/*-FP4) or llm-compressor (compressed-tensors).

One tensor per expert and projection (:mod:`.nvfp4_experts`); router ``mlp.gate.weight`` BF16 and
``mlp.gate.e_score_correction_bias`` F32 (the kernel's ``routing_bias``); MoE layers from
``first_k_dense_replace`` on, every ``moe_layer_freq``-th; the multi-token-prediction layer
(index ``num_hidden_layers``, BF16 in ModelOpt's exports) is not one. Routing: sigmoid scores,
correction bias for the choice only, grouped top-k, renormalised, times
``routed_scaling_factor`` (FlashInfer ``RoutingMethodType.DeepSeekV3``).
"""

from __future__ import annotations

from moeshard.checkpoints.families.base import Family, ModelSpec, model_root, positive_ints
from moeshard.checkpoints.families.nvfp4_experts import PerExpertNvfp4
from moeshard.checkpoints.source import Checkpoint
from moeshard.errors import MoeshardError
from moeshard.layouts.kernel import ActivationType, RoutingMethod, routing_problems

#: The router stays unquantized: BF16 (DeepSeek-R1-FP4), F32 in some exports.
ROUTER_DTYPES = ("BF16", "F32")


class DeepSeekAdapter(PerExpertNvfp4):
    family = Family.DEEPSEEK
    model_types = ("deepseek_v3", "kimi_k2", "kimi_k25")
    layers_key = "num_hidden_layers"
    experts_key = "n_routed_experts"

    def text(self, config: dict) -> dict:
        """Kimi-K2.5 nests the DeepSeek-V3 text model under ``text_config``."""
        nested = config.get("text_config")
        return nested if isinstance(nested, dict) and "n_routed_experts" not in config else config

    def templates(self, config: dict, names) -> tuple[str, dict[str, str]]:
        root = model_root(names)
        return (f"{root}.layers.{{layer}}.mlp.experts",
                {"weight": f"{root}.layers.{{layer}}.mlp.gate.weight",
                 "correction_bias": f"{root}.layers.{{layer}}.mlp.gate.e_score_correction_bias"})

    def moe_layers(self, config: dict) -> tuple[int, ...]:
        """Layers first_k_dense_replace.. (every moe_layer_freq-th); the MTP layer is not one."""
        cfg = self.text(config)
        first, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
        return tuple(x for x in range(cfg["num_hidden_layers"]) if x >= first and x % freq == 0)

    def spec(self, ckpt: Checkpoint) -> ModelSpec:
        config = ckpt.config
        where, names, scheme, cfg = self.read_config(ckpt)
        keys = ("n_routed_experts", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                "num_experts_per_tok", "n_group", "topk_group")
        positive_ints(cfg, where, keys)
        e, h, i = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
        if h % 16 or i % 16:
            raise MoeshardError(f"{where}: hidden_size {h}, moe_intermediate_size {i}: expected multiples of 16")
        routing = {"routing_method_type": RoutingMethod.DeepSeekV3, "top_k": cfg["num_experts_per_tok"],
                   "n_group": cfg["n_group"], "topk_group": cfg["topk_group"],
                   "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
                   "norm_topk_prob": bool(cfg.get("norm_topk_prob", True))}
        if problems := routing_problems(routing, e):
            raise MoeshardError(f"{where}: the trtllm-gen kernel cannot route this model: {'; '.join(problems)}")
        prefix, router = self.templates(config, names)
        layers = tuple(x for x in self.moe_layers(config) if self.quantized_layer(scheme, prefix.format(layer=x)))
        if not layers:
            raise MoeshardError(f"{where}: no NVFP4 MoE layer (num_hidden_layers {cfg['num_hidden_layers']}, "
                                f"first_k_dense_replace {cfg.get('first_k_dense_replace', 0)}, and what the quant "
                                "config quantized)")
        expert_names = set()
        why = f"from config.json hidden_size={h}, moe_intermediate_size={i}"
        for layer in layers:
            expert_names |= self.expect_experts(ckpt, scheme.names, prefix.format(layer=layer), e, h, i, why)
            ckpt.expect(router["weight"].format(layer=layer), ROUTER_DTYPES, (e, h),
                        f"from config.json n_routed_experts={e}, hidden_size={h}")
            bias = router["correction_bias"].format(layer=layer)
            if bias not in ckpt.absent and ckpt.info(bias).shape != (e,):
                raise MoeshardError(f"{ckpt.info(bias).file}: {bias}: expected shape [{e}], "
                                    f"found {list(ckpt.info(bias).shape)}")
        return ModelSpec(family=self.family, quant_format=scheme.format, num_experts=e, hidden_size=h,
                         intermediate_size=i, moe_layers=layers, expert_prefix=prefix, routing=routing,
                         activation={"type": "swiglu", "activation_type": ActivationType.Swiglu}, router=router,
                         expert_tensors=frozenset(expert_names), scheme=scheme, fused=False)
