"""llm-compressor's compressed-tensors NVFP4 export (``quantization_config.quant_method:
compressed-tensors``, ``format: nvfp4-pack-quantized``): per quantized Linear ``weight_packed``
U8 ``[N, K/2]``, ``weight_scale`` F8_E4M3 ``[N, K/16]``, ``weight_global_scale`` and
``input_global_scale`` F32 ``[1]`` (the reciprocals of ModelOpt's ``weight_scale_2`` and
``input_scale``); config groups say what is quantized (``targets``, ``Linear`` or ``re:``
regexes), ``ignore`` what is not (names or ``re:`` regexes). compressed-tensors
``quantization/quant_scheme.py`` (NVFP4: num_bits 4, type float, strategy tensor_group,
group_size 16), ``compressors/quantized_compressors/nvfp4_quantized.py``."""

from __future__ import annotations

from moeshard.checkpoints.formats import COMPRESSED_TENSORS_NAMES, QuantFormat, Scheme
from moeshard.errors import MoeshardError

NVFP4_FORMAT = "nvfp4-pack-quantized"
#: Other compressed-tensors formats, for the refusal.
OTHER_FORMATS = {"pack-quantized": "INT4/INT8 packed", "float-quantized": "FP8", "naive-quantized": "INT8/FP8",
                 "int-quantized": "INT8", "mxfp4-pack-quantized": "MXFP4 from another exporter than GPT-OSS's",
                 "marlin-24": "INT4 2:4 sparse", "dense": "not quantized"}


def scheme(q: dict, where: str) -> Scheme:
    """The :class:`Scheme` of a compressed-tensors ``quantization_config``."""
    groups = q.get("config_groups") or {}
    formats = {(g or {}).get("format") or q.get("format") for g in groups.values()} or {q.get("format")}
    if formats != {NVFP4_FORMAT}:
        found = ", ".join(sorted(str(f) for f in formats))
        what = ", ".join(OTHER_FORMATS.get(f, "") for f in sorted(str(f) for f in formats) if f in OTHER_FORMATS)
        raise MoeshardError(f"{where}: quantization_config.format: expected {NVFP4_FORMAT!r} (compressed-tensors "
                            f"NVFP4), found {found}" + (f" ({what})" if what else ""))
    for name, g in groups.items():
        w = (g or {}).get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", 16):
            raise MoeshardError(f"{where}: config_groups.{name}.weights: expected num_bits 4, type float, group_size "
                                f"16 (NVFP4), found {w.get('num_bits')}, {w.get('type')}, {w.get('group_size')}")
        targets = (g or {}).get("targets") or []
        if any(t != "Linear" and not str(t).startswith("re:") for t in targets):
            raise MoeshardError(f"{where}: config_groups.{name}.targets: expected Linear or re: patterns, found "
                                f"{targets}")
    ignore = tuple(str(x) for x in q.get("ignore") or [] if str(x).startswith("re:") or "." in str(x)
                   or str(x) == "lm_head")  # class names (e.g. Llama4TextAttention) name no expert
    return Scheme("compressed-tensors", QuantFormat.NVFP4, COMPRESSED_TENSORS_NAMES, exclude=ignore,
                  kv_cache=(q.get("kv_cache_scheme") or {}).get("type"))
