"""NVFP4 experts stored one Linear per expert and projection, ``{prefix}.{e}.{gate,up,down}_proj.{leaf}``,
as ModelOpt and llm-compressor export DeepSeek-V3 / Kimi-K2, Qwen3-MoE and (llm-compressor, which
unfuses them) Llama-4: the reads and header checks those families share.

Leaves and the inversion of the per-tensor scales come from the checkpoint's exporter
(:class:`~moeshard.checkpoints.formats.Nvfp4Names`): ModelOpt ``weight`` / ``weight_scale`` /
``weight_scale_2`` / ``input_scale``; compressed-tensors ``weight_packed`` / ``weight_scale`` /
``weight_global_scale`` / ``input_global_scale`` (reciprocals). Gate and up may have different
per-tensor scales; the layer's activation scales are the maxima over all experts and over gate
and up (vLLM ``prepare_nvfp4_moe_layer_for_fi_or_cutlass``: ``a13_scale.max()``).
"""

from __future__ import annotations

import itertools
import math

import torch

from moeshard.checkpoints.families.base import AdapterBase, ModelSpec
from moeshard.checkpoints.formats import Nvfp4Names, QuantFormat, Scheme
from moeshard.checkpoints.formats.modelopt import positive_finite
from moeshard.checkpoints.source import Checkpoint, has_nan
from moeshard.errors import MoeshardError

GATE, UP, DOWN = "gate_proj", "up_proj", "down_proj"


def linear_tensors(names: Nvfp4Names, n: int, k: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors of one NVFP4 Linear with weight ``[n, k]``: leaf -> (dtype, shape); per-tensor
    scales are ``[]`` (ModelOpt) or ``[1]`` (compressed-tensors), both accepted."""
    return {names.weight: ("U8", (n, k // 2)), names.block_scale: ("F8_E4M3", (n, k // 16)),
            names.global_scale: ("F32", ()), names.input_scale: ("F32", ())}


def per_tensor(ckpt: Checkpoint, names: list[str], reciprocal: bool) -> torch.Tensor:
    """Per-tensor scales ``[len(names)]`` float32 (one value each), inverted for an exporter that
    stores ``1 / scale``; a MoeshardError naming the tensor for a missing, zero or non-finite one."""
    out = torch.empty(len(names), dtype=torch.float32)
    for j, name in enumerate(names):
        info = ckpt.info(name)
        if math.prod(info.shape) != 1:
            raise MoeshardError(f"{info.file}: {name}: expected one value, found {math.prod(info.shape)}")
        out[j:j + 1].copy_(ckpt.read(name).reshape(-1))
    bad = ~(torch.isfinite(out) & (out > 0))
    if bad.any():  # checked once for all; the first bad one named
        j = int(bad.nonzero()[0])
        positive_finite(ckpt, names[j], out[j:j + 1])
    return 1.0 / out if reciprocal else out


class PerExpertNvfp4(AdapterBase):
    """Reads for the families whose NVFP4 experts are one Linear per expert and projection."""

    def accepts(self, scheme: Scheme) -> bool:
        return scheme.format is QuantFormat.NVFP4

    # -- headers ---------------------------------------------------------------------------------
    def expect_experts(self, ckpt: Checkpoint, names: Nvfp4Names, prefix: str, e: int, h: int, i: int,
                       why: str) -> set[str]:
        """Check every expert's tensors of one layer (dtype and shape); their names."""
        found = set()
        for x in range(e):
            for proj, (n, k) in ((GATE, (i, h)), (UP, (i, h)), (DOWN, (h, i))):
                for leaf, (dtype, shape) in linear_tensors(names, n, k).items():
                    name = f"{prefix}.{x}.{proj}.{leaf}"
                    ckpt.expect(name, dtype, shape, why, scalar_ok=True)
                    found.add(name)
        return found

    def quantized_layer(self, scheme: Scheme, prefix: str) -> bool:
        """Whether the scheme quantized this layer's experts (ModelOpt's exclude list or
        MIXED_PRECISION quantized_layers; compressed-tensors' ignore list), judged by expert 0's
        projections; the header checks then hold every expert to it."""
        return all(scheme.quantized(f"{prefix}.0.{proj}") for proj in (GATE, UP, DOWN))

    # -- reads -----------------------------------------------------------------------------------
    def source_leaves(self, spec: ModelSpec, field: str) -> tuple[str, ...]:
        n = spec.scheme.names
        return {"w13": (f"{UP}.{n.weight}", f"{GATE}.{n.weight}"), "w2": (f"{DOWN}.{n.weight}",),
                "w13_scale": (f"{UP}.{n.block_scale}", f"{GATE}.{n.block_scale}"),
                "w2_scale": (f"{DOWN}.{n.block_scale}",)}.get(field, ())

    def shared_leaves(self, spec: ModelSpec) -> tuple[str, ...]:
        return (spec.scheme.names.input_scale,)

    def read_per_expert(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, field: str, start: int, stop: int,
                        pin: bool = False) -> tuple[torch.Tensor, None] | None:
        """Experts ``[start, stop)`` of one canonical field: each expert's ``[up ; gate]`` rows read
        straight into one ``[n, rows, cols]`` uint8 tensor (pinned with ``pin``); block scales
        checked for NaN codes over the whole, the first bad tensor named."""
        leaves = self.source_leaves(spec, field)
        if not leaves:
            return None  # no biases
        p = spec.prefix(layer)
        rows = [ckpt.info(f"{p}.{start}.{leaf}").shape[0] for leaf in leaves]
        cols = ckpt.info(f"{p}.{start}.{leaves[0]}").shape[1]
        out = torch.empty((stop - start, sum(rows), cols), dtype=torch.uint8, pin_memory=pin)
        parts = [(f"{p}.{x}.{leaf}", out[x - start, r - n:r])
                 for x in range(start, stop) for leaf, n, r in zip(leaves, rows, itertools.accumulate(rows))]
        for name, part in parts:
            ckpt.read(name, out=part)
        if field.endswith("_scale") and has_nan(out, True):
            for name, part in parts:
                ckpt.check_scales(name, part, True)
        return out, None

    def scalars_per_expert(self, ckpt: Checkpoint, spec: ModelSpec, layer: int, start: int, stop: int
                           ) -> dict[str, torch.Tensor]:
        """``w1_scale_2`` (gate), ``w3_scale_2`` (up), ``w2_scale_2``, ``w13_input_scale`` (the larger of
        gate's and up's), ``w2_input_scale``: ``[n]`` float32."""
        n, p = spec.scheme.names, spec.prefix(layer)
        xs = range(start, stop)
        rd = lambda proj, leaf: per_tensor(ckpt, [f"{p}.{x}.{proj}.{leaf}" for x in xs], n.reciprocal)  # noqa: E731
        return {"w1_scale_2": rd(GATE, n.global_scale), "w3_scale_2": rd(UP, n.global_scale),
                "w2_scale_2": rd(DOWN, n.global_scale),
                "w13_input_scale": torch.maximum(rd(GATE, n.input_scale), rd(UP, n.input_scale)),
                "w2_input_scale": rd(DOWN, n.input_scale)}

    def input_scales_per_expert(self, ckpt: Checkpoint, spec: ModelSpec, layer: int
                                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a13, a2)``: the layer's maxima of the GEMM1 (gate and up) and GEMM2 activation scales
        over all experts (compressed-tensors: 1 / the minima of the stored global scales)."""
        n, p = spec.scheme.names, spec.prefix(layer)
        rd = lambda projs: per_tensor(ckpt, [f"{p}.{x}.{proj}.{n.input_scale}" for x in range(spec.num_experts)  # noqa: E731
                                             for proj in projs], n.reciprocal)
        return rd((GATE, UP)).max(), rd((DOWN,)).max()

    read_raw = read_per_expert
    read_scalars = scalars_per_expert
    input_scales = input_scales_per_expert
