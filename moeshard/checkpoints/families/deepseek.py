"""nvidia/DeepSeek-R1-FP4 (ModelOpt NVFP4): one tensor per expert and projection."""

from __future__ import annotations

import torch

from moeshard.checkpoints.families.base import AdapterBase, Family, ModelSpec, check_sizes, positive_ints
from moeshard.checkpoints.formats import QuantFormat
from moeshard.checkpoints.formats.modelopt import check_group_size, nvfp4_quant_algo, read_scalar
from moeshard.checkpoints.source import Checkpoint
from moeshard.errors import MoeshardError
from moeshard.layouts.kernel import ActivationType, RoutingMethod

PREFIX = "model.layers.{layer}.mlp.experts"
#: Per expert M and projection P in (gate_proj, up_proj, down_proj), nvidia/DeepSeek-R1-FP4
#: model-000NN-of-000163.safetensors (ModelOpt per-Linear export): leaf -> (dtype, shape(N, K)).
LINEAR_TENSORS = {
    "weight": ("U8", lambda n, k: (n, k // 2)),  # packed E2M1, low nibble = even k
    "weight_scale": ("F8_E4M3", lambda n, k: (n, k // 16)),  # row-major block scales
    "weight_scale_2": ("F32", lambda n, k: ()),  # per-tensor scale (amax / (6 * 448))
    "input_scale": ("F32", lambda n, k: ()),  # activation scale from calibration
}
ROUTER = {"weight": "model.layers.{layer}.mlp.gate.weight",
          "correction_bias": "model.layers.{layer}.mlp.gate.e_score_correction_bias"}


class DeepSeekAdapter(AdapterBase):
    family = Family.DEEPSEEK
    prefix = PREFIX
    router = ROUTER
    shared_leaves = ("input_scale",)
    layers_key = "num_hidden_layers"
    experts_key = "n_routed_experts"

    @staticmethod
    def moe_layers(cfg: dict) -> tuple[int, ...]:
        """Layers first_k_dense_replace.. (every moe_layer_freq-th); the MTP layer is not one."""
        first, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
        return tuple(x for x in range(cfg["num_hidden_layers"]) if x >= first and x % freq == 0)

    def detect(self, config: dict, quant_config: dict | None) -> bool:
        return config.get("model_type") == "deepseek_v3" and nvfp4_quant_algo(config, quant_config) == "NVFP4"

    def spec(self, ckpt: Checkpoint) -> ModelSpec:
        cfg, where = ckpt.config, ckpt.root / "config.json"
        check_sizes(self, ckpt.config, [*ckpt.tensors, *ckpt.absent], where)
        check_group_size(ckpt)
        positive_ints(cfg, where, ("n_routed_experts", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                                   "num_experts_per_tok", "n_group", "topk_group"))
        e, h, i = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
        ng, kg, k = cfg["n_group"], cfg["topk_group"], cfg["num_experts_per_tok"]
        if e % ng or kg > ng or k > e:
            raise MoeshardError(f"{where}: routing: expected n_group dividing n_routed_experts, topk_group <= n_group "
                                f"and num_experts_per_tok <= n_routed_experts, found n_routed_experts {e}, "
                                f"n_group {ng}, topk_group {kg}, num_experts_per_tok {k}")
        if h % 16 or i % 16:
            raise MoeshardError(f"{where}: hidden_size {h}, moe_intermediate_size {i}: expected multiples of 16")
        layers = self.moe_layers(cfg)
        if not layers:
            raise MoeshardError(f"{where}: no MoE layer (num_hidden_layers {cfg['num_hidden_layers']}, "
                                f"first_k_dense_replace {cfg.get('first_k_dense_replace', 0)})")
        names = set()
        why = f"from config.json hidden_size={h}, moe_intermediate_size={i}"
        for layer in layers:
            p = PREFIX.format(layer=layer)
            for x in range(e):
                for proj, (n, k) in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                    for leaf, (dtype, shape) in LINEAR_TENSORS.items():
                        name = f"{p}.{x}.{proj}.{leaf}"
                        ckpt.expect(name, dtype, shape(n, k), why, scalar_ok=True)
                        names.add(name)
            ckpt.expect(ROUTER["weight"].format(layer=layer), "BF16", (e, h), f"from config.json n_routed_experts={e}, "
                        f"hidden_size={h}")
            bias_name = ROUTER["correction_bias"].format(layer=layer)
            if bias_name not in ckpt.absent and ckpt.info(bias_name).shape != (e,):
                raise MoeshardError(f"{ckpt.info(bias_name).file}: {bias_name}: expected shape [{e}], "
                                    f"found {list(ckpt.info(bias_name).shape)}")
        return ModelSpec(
            family=self.family, quant_format=QuantFormat.NVFP4, num_experts=e, hidden_size=h, intermediate_size=i,
            moe_layers=layers, expert_prefix=PREFIX,
            routing={"routing_method_type": RoutingMethod.DeepSeekV3, "top_k": cfg["num_experts_per_tok"],
                     "n_group": cfg["n_group"], "topk_group": cfg["topk_group"],
                     "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
                     "norm_topk_prob": bool(cfg.get("norm_topk_prob", True))},
            activation={"type": "swiglu", "activation_type": ActivationType.Swiglu},
            router=dict(ROUTER), expert_tensors=frozenset(names))

    #: Canonical field -> its source tensors per expert, in canonical row order (for prefetching).
    sources = {"w13": ("up_proj.weight", "gate_proj.weight"), "w2": ("down_proj.weight",),
               "w13_scale": ("up_proj.weight_scale", "gate_proj.weight_scale"), "w2_scale": ("down_proj.weight_scale",)}

    def read_raw(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, field: str, start: int, stop: int
                 ) -> tuple[torch.Tensor, None] | None:
        """Experts ``[start, stop)`` of one canonical field (``[up ; gate]`` rows stacked: one copy)."""
        if field not in self.sources:
            return None  # no biases
        p = spec.prefix(layer)
        parts = []
        for x in range(start, stop):
            for leaf in self.sources[field]:
                name = f"{p}.{x}.{leaf}"
                t = ckpt.read(name).view(torch.uint8)
                parts.append(ckpt.check_scales(name, t, True) if field.endswith("_scale") else t)
        return torch.cat(parts).view(stop - start, -1, parts[0].shape[1]), None  # one copy

    def read_scalars(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, start: int, stop: int
                     ) -> dict[str, torch.Tensor]:
        """``w1_scale_2`` (gate), ``w3_scale_2`` (up), ``w2_scale_2``, ``w13_input_scale``,
        ``w2_input_scale``: ``[n]`` float32. Gate and up may have different scales."""
        p = spec.prefix(layer)
        g2, u2, d2, gi, di = [], [], [], [], []
        for x in range(start, stop):
            sc = lambda proj, leaf: read_scalar(ckpt, f"{p}.{x}.{proj}.{leaf}")  # noqa: E731
            g2.append(sc("gate_proj", "weight_scale_2"))
            u2.append(sc("up_proj", "weight_scale_2"))
            d2.append(sc("down_proj", "weight_scale_2"))
            gi.append(torch.maximum(sc("gate_proj", "input_scale"), sc("up_proj", "input_scale")))
            di.append(sc("down_proj", "input_scale"))
        return {"w1_scale_2": torch.stack(g2), "w3_scale_2": torch.stack(u2), "w2_scale_2": torch.stack(d2),
                "w13_input_scale": torch.stack(gi), "w2_input_scale": torch.stack(di)}

    def input_scales(self, ckpt: Checkpoint, spec: ModelSpec, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a13, a2)``: the layer's maxima of GEMM1 and GEMM2 ``input_scale`` over all experts."""
        p = spec.prefix(layer)
        a13 = max(read_scalar(ckpt, f"{p}.{x}.{proj}.input_scale") for x in range(spec.num_experts)
                  for proj in ("gate_proj", "up_proj"))
        a2 = max(read_scalar(ckpt, f"{p}.{x}.down_proj.input_scale") for x in range(spec.num_experts))
        return a13, a2
