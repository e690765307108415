"""Llama-4 in NVFP4: Scout (16 experts, every layer MoE) and Maverick (128 experts,
``interleave_moe_layer_step: 2``: MoE on every second layer, a dense MLP on the others, which
goes to common/ as it is), from ModelOpt (nvidia/*-FP4) or llm-compressor.

ModelOpt exports ``Llama4TextExperts`` fused across experts in transformers' bmm layout
``[E, K, N]``: it quantizes the ``[E, N, K]`` transpose (blocks along K, the input dim) and stores
weight and block scale transposed back; ``*_weight_scale_2`` and ``*_input_scale`` are one value
for all experts (``[]`` or ``[1]``) or one per expert (``[E]``; vLLM ``mllama4.py``,
``_handle_expert_scale_broadcasting``). Gate is the first half of the 2I axis, up the second
(transformers ``gate_up.chunk(2, -1)``; vLLM ``chunk(2, dim=-2)`` after its transpose). Keys sit
under ``language_model.model.`` or ``model.`` (vLLM renames the one to the other; SGLang adds the
prefix when missing). llm-compressor unfuses the experts into one Linear per expert and
projection (``modeling/llama4.py``, ``SequentialLlama4TextMoe``): :mod:`.nvfp4_experts`.
Routing: top-1, sigmoid, the weight applied to the expert's input (FlashInfer ``Llama4``).
"""

from __future__ import annotations

import torch

from moeshard.checkpoints.families.base import Family, ModelSpec, model_root, positive_ints
from moeshard.checkpoints.families.nvfp4_experts import PerExpertNvfp4
from moeshard.checkpoints.formats.modelopt import positive_finite
from moeshard.checkpoints.source import Checkpoint
from moeshard.errors import MoeshardError
from moeshard.layouts.kernel import ActivationType, RoutingMethod, routing_problems

#: ModelOpt's fused experts, per MoE layer: leaf -> (dtype, shape(E, H, I)); the per-tensor scales
#: are ``[]``, ``[1]`` or ``[E]``.
FUSED_TENSORS = {
    "gate_up_proj": ("U8", lambda e, h, i: (e, h // 2, 2 * i)),  # [E, K/2, N], N = [gate ; up]
    "gate_up_proj_weight_scale": ("F8_E4M3", lambda e, h, i: (e, h // 16, 2 * i)),
    "gate_up_proj_weight_scale_2": ("F32", None),
    "gate_up_proj_input_scale": ("F32", None),
    "down_proj": ("U8", lambda e, h, i: (e, i // 2, h)),
    "down_proj_weight_scale": ("F8_E4M3", lambda e, h, i: (e, i // 16, h)),
    "down_proj_weight_scale_2": ("F32", None),
    "down_proj_input_scale": ("F32", None),
}


class Llama4Adapter(PerExpertNvfp4):
    family = Family.LLAMA4
    model_types = ("llama4",)
    layers_key = "num_hidden_layers"
    experts_key = "num_local_experts"

    def text(self, config: dict) -> dict:
        return config.get("text_config")

    def templates(self, config: dict, names) -> tuple[str, dict[str, str]]:
        root = model_root(names)
        return (f"{root}.layers.{{layer}}.feed_forward.experts",
                {"weight": f"{root}.layers.{{layer}}.feed_forward.router.weight"})

    def moe_layers(self, config: dict) -> tuple[int, ...]:
        """``text_config.moe_layers``, else every ``interleave_moe_layer_step``-th layer from
        ``step - 1`` on (transformers ``Llama4TextConfig``; vLLM: ``(layer + 1) % step == 0``)."""
        cfg = self.text(config) or {}
        step = cfg.get("interleave_moe_layer_step", 1) or 1
        return tuple(cfg.get("moe_layers") or range(step - 1, cfg.get("num_hidden_layers", 0), step))

    def spec(self, ckpt: Checkpoint) -> ModelSpec:
        config = ckpt.config
        where, names, scheme, cfg = self.read_config(ckpt)
        positive_ints(cfg, f"{where}: text_config", ("num_local_experts", "hidden_size", "intermediate_size",
                                                      "num_hidden_layers", "num_experts_per_tok"))
        e, h, i = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
        routing = {"routing_method_type": RoutingMethod.Llama4, "top_k": cfg["num_experts_per_tok"],
                   "n_group": None, "topk_group": None, "routed_scaling_factor": None, "apply_weight_on_input": True}
        if problems := routing_problems(routing, e):
            raise MoeshardError(f"{where}: the trtllm-gen kernel cannot route this model: {'; '.join(problems)}")
        prefix, router = self.templates(config, names)
        moe = self.moe_layers(config)
        fused = any(n == f"{prefix.format(layer=moe[0])}.gate_up_proj" for n in names) if moe else True
        quantized = (lambda p: scheme.quantized(p)) if fused else (lambda p: self.quantized_layer(scheme, p))
        layers = tuple(x for x in moe if quantized(prefix.format(layer=x)))
        if not layers:
            raise MoeshardError(f"{where}: no NVFP4 MoE layer (text_config moe layers and what the quant config "
                                "quantized leave none)")
        expert_names = set()
        why = f"from config.json text_config num_local_experts={e}, hidden_size={h}, intermediate_size={i}"
        for layer in layers:
            p = prefix.format(layer=layer)
            if not fused:
                expert_names |= self.expect_experts(ckpt, scheme.names, p, e, h, i, why)
            for leaf, (dtype, shape) in FUSED_TENSORS.items() if fused else ():
                name = f"{p}.{leaf}"
                if shape is None:  # a per-tensor scale: one value, or one per expert
                    t = ckpt.expect(name, dtype, None)
                    if t is not None and t.shape not in ((), (1,), (e,)):
                        raise MoeshardError(f"{t.file}: {name}: expected shape [], [1] or [{e}] (one value for all "
                                            f"experts or one per expert), found {list(t.shape)}")
                else:
                    ckpt.expect(name, dtype, shape(e, h, i), why)
                expert_names.add(name)
            ckpt.expect(router["weight"].format(layer=layer), ("BF16", "F32"), (e, h), why)
        return ModelSpec(family=self.family, quant_format=scheme.format, num_experts=e, hidden_size=h,
                         intermediate_size=i, moe_layers=layers, expert_prefix=prefix, routing=routing,
                         activation={"type": "swiglu", "activation_type": ActivationType.Swiglu}, router=router,
                         expert_tensors=frozenset(expert_names), scheme=scheme, fused=fused)

    # -- reads: fused (ModelOpt) or one tensor per expert (llm-compressor) --------------------------
    #: Canonical field -> its fused source tensor.
    FUSED_SOURCES = {"w13": "gate_up_proj", "w13_scale": "gate_up_proj_weight_scale", "w2": "down_proj",
                     "w2_scale": "down_proj_weight_scale"}

    def source_leaves(self, spec: ModelSpec, field: str) -> tuple[str, ...]:
        if not spec.fused:
            return super().source_leaves(spec, field)
        return (self.FUSED_SOURCES[field],) if field in self.FUSED_SOURCES else ()

    def shared_leaves(self, spec: ModelSpec) -> tuple[str, ...]:
        return () if spec.fused else super().shared_leaves(spec)

    def read_raw(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, field: str, start: int, stop: int,
                 pin: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Experts ``[start, stop)`` of one canonical field. Fused: the bmm-layout tensor ``[n, K', N]``
        transposed to ``[n, N, K']`` (one copy); GEMM1's N is ``[gate ; up]``, so its row map swaps
        the halves into ``[up ; gate]``."""
        if not spec.fused:
            return self.read_per_expert(ckpt, spec, layer, field, start, stop, pin)
        if field not in self.FUSED_SOURCES:
            return None  # no biases
        name = f"{spec.prefix(layer)}.{self.FUSED_SOURCES[field]}"
        t = ckpt.read(name, start, stop)
        if field.endswith("_scale"):
            t = ckpt.check_scales(name, t, True, start).view(torch.uint8)
        t = t.transpose(1, 2).contiguous()
        i = t.shape[1] // 2
        return t, (torch.cat((torch.arange(i, 2 * i), torch.arange(i))) if field.startswith("w13") else None)

    def _fused_scale(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, leaf: str, start: int, stop: int
                     ) -> torch.Tensor:
        """A fused per-tensor scale for experts ``[start, stop)``: ``[n]`` float32 (one stored value
        broadcast, or the experts' own)."""
        name = f"{spec.prefix(layer)}.{leaf}"
        t = positive_finite(ckpt, name, ckpt.read(name).float().reshape(-1))
        return (t.expand(spec.num_experts) if t.numel() == 1 else t)[start:stop].clone()

    def read_scalars(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, start: int, stop: int
                     ) -> dict[str, torch.Tensor]:
        """``w1_scale_2``, ``w3_scale_2`` (fused: gate and up share one), ``w2_scale_2``,
        ``w13_input_scale``, ``w2_input_scale``: ``[n]`` float32."""
        if not spec.fused:
            return self.scalars_per_expert(ckpt, spec, layer, start, stop)
        rd = lambda leaf: self._fused_scale(ckpt, spec, layer, leaf, start, stop)  # noqa: E731
        s13 = rd("gate_up_proj_weight_scale_2")
        return {"w1_scale_2": s13, "w3_scale_2": s13.clone(), "w2_scale_2": rd("down_proj_weight_scale_2"),
                "w13_input_scale": rd("gate_up_proj_input_scale"), "w2_input_scale": rd("down_proj_input_scale")}

    def input_scales(self, ckpt: Checkpoint, spec: ModelSpec, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a13, a2)``: the maxima over all experts of the activation scales."""
        if not spec.fused:
            return self.input_scales_per_expert(ckpt, spec, layer)
        rd = lambda leaf: self._fused_scale(ckpt, spec, layer, leaf, 0, spec.num_experts).max()  # noqa: E731
        return rd("gate_up_proj_input_scale"), rd("down_proj_input_scale")
