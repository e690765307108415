"""Quantization formats of the checkpoints and the exporters that write them.

A :class:`Scheme` says how one checkpoint is quantized: the format (MXFP4 or NVFP4), the
exporter (OpenAI's GPT-OSS release, NVIDIA ModelOpt, llm-compressor's compressed-tensors), how
that exporter names an NVFP4 Linear's tensors (:class:`Nvfp4Names`), and which modules it
quantized (:meth:`Scheme.quantized`, from the exclude / ignore lists or ModelOpt's per-layer
``quantized_layers``). :func:`detect_scheme` reads it from config.json and hf_quant_config.json
and refuses, in one line, anything moeshard cannot convert. Per format: :mod:`.fp4` (the codecs),
:mod:`.modelopt`, :mod:`.compressed_tensors`.
"""

from __future__ import annotations

import enum
import fnmatch
import re
from dataclasses import dataclass, field

from moeshard.errors import MoeshardError


class QuantFormat(str, enum.Enum):
    MXFP4 = "mxfp4"  # E2M1 values, one UE8M0 scale per 32
    NVFP4 = "nvfp4"  # E2M1 values, one E4M3 scale per 16, and a float32 per-tensor scale

    @property
    def sf_vec_size(self) -> int:
        """Elements per block scale."""
        return 32 if self is QuantFormat.MXFP4 else 16


@dataclass(frozen=True)
class Nvfp4Names:
    """How an exporter names the tensors of one NVFP4 Linear ``{module}.{leaf}`` (or, for fused
    experts, ``{module}.{proj}_{leaf}``), and whether it stores the per-tensor scales inverted.

    ModelOpt: ``weight`` U8 ``[N, K/2]``, ``weight_scale`` F8_E4M3 ``[N, K/16]``, ``weight_scale_2``
    F32 (amax / 2688), ``input_scale`` F32 (calibration amax / 2688). compressed-tensors:
    ``weight_packed``, ``weight_scale``, ``weight_global_scale`` F32 ``[1]`` (2688 / amax = 1 /
    ModelOpt's weight_scale_2) and ``input_global_scale`` (1 / input_scale): dequantization is
    ``fp4 * weight_scale / weight_global_scale`` (compressed_tensors ``lifecycle/forward.py``).
    Both pack the even element in the low nibble.
    """

    weight: str
    block_scale: str
    global_scale: str
    input_scale: str
    reciprocal: bool  # the per-tensor scales are stored as 1 / scale


MODELOPT_NAMES = Nvfp4Names("weight", "weight_scale", "weight_scale_2", "input_scale", reciprocal=False)
COMPRESSED_TENSORS_NAMES = Nvfp4Names("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale",
                                      reciprocal=True)


@dataclass(frozen=True)
class Scheme:
    """How one checkpoint is quantized (see the module docstring).

    ``exclude``: fnmatch patterns (ModelOpt ``exclude_modules`` / ``ignore``) or ``re:`` regexes
    (compressed-tensors ``ignore``) of modules left unquantized; ``layers``: ModelOpt
    MIXED_PRECISION's per-module algorithm (then only the modules it lists as NVFP4 are).
    """

    exporter: str  # "openai", "modelopt" or "compressed-tensors"
    format: QuantFormat
    names: Nvfp4Names | None = None
    exclude: tuple[str, ...] = ()
    layers: dict[str, str] | None = field(default=None, hash=False)
    kv_cache: str | None = None

    def quantized(self, module: str) -> bool:
        """Whether module ``module`` (a Linear's name, e.g. ``model.layers.3.mlp.experts.0.gate_proj``,
        or a fused experts module) holds this scheme's FP4 weights."""
        names = _spellings(module)
        if self.layers is not None:
            return any(self.layers.get(n, "").upper() == "NVFP4" for n in names)
        return not any(_matches(p, n) for p in self.exclude for n in names)


def _spellings(module: str) -> tuple[str, ...]:
    """A module's name as engines compare it: with and without Llama-4's / Kimi-K2.5's
    ``language_model.`` prefix (vLLM ``mllama4.py`` renames ``model.`` to ``language_model.model.``)."""
    if module.startswith("language_model."):
        return module, module[len("language_model."):]
    return module, "language_model." + module


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], module) is not None
    return module == pattern or module.startswith(pattern + ".") or fnmatch.fnmatchcase(module, pattern)


def detect_scheme(config: dict, quant_config: dict | None, root) -> Scheme:
    """The quantization scheme of a checkpoint, or a one-line MoeshardError saying what was found
    and what is supported. ``hf_quant_config.json`` (legacy ModelOpt) decides over config.json's
    ``quantization_config``: DeepSeek-V3-0324-FP4 keeps its FP8 source's quantization_config
    beside an NVFP4 hf_quant_config.json (SGLang issue #7593). ``root``: the checkpoint folder (for
    messages)."""
    from moeshard.checkpoints.formats import compressed_tensors, modelopt

    where = f"{root}/config.json"
    if quant_config is not None:
        return modelopt.scheme(quant_config.get("quantization") or {}, f"{root}/hf_quant_config.json")
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        raise MoeshardError(f"{where}: no quantization_config and no hf_quant_config.json: not a quantized checkpoint "
                            "(moeshard converts MXFP4 and NVFP4 MoE checkpoints)")
    method = q.get("quant_method")
    if method == "mxfp4":
        return Scheme("openai", QuantFormat.MXFP4)
    if method == "modelopt":
        return modelopt.scheme(q, where)
    if method == "compressed-tensors":
        return compressed_tensors.scheme(q, where)
    raise MoeshardError(f"{where}: quantization_config.quant_method: found {method!r} "
                        f"({_describe(q)}); supported: mxfp4 (GPT-OSS), modelopt NVFP4 (hf_quant_config.json or "
                        "quant_method modelopt), compressed-tensors nvfp4-pack-quantized")


def _describe(q: dict) -> str:
    fmt = q.get("fmt") or q.get("format") or q.get("quant_type") or q.get("bits")
    return f"format {fmt!r}" if fmt else "not FP4"


__all__ = ["COMPRESSED_TENSORS_NAMES", "MODELOPT_NAMES", "Nvfp4Names", "QuantFormat", "Scheme", "detect_scheme"]
