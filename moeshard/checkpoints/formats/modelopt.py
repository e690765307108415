"""NVIDIA ModelOpt's NVFP4 export, as every ModelOpt family writes it: per Linear (or per fused
expert tensor) ``weight`` U8 ``[N, K/2]`` (low nibble = even element), ``weight_scale`` F8_E4M3
``[N, K/16]``, ``weight_scale_2`` F32 (amax / (6 * 448)) and ``input_scale`` F32 (calibration
amax / (6 * 448)); the quant config in ``hf_quant_config.json`` (legacy:
``{"producer", "quantization": {quant_algo, kv_cache_quant_algo, group_size, exclude_modules}}``)
or in config.json's ``quantization_config`` with ``quant_method: modelopt`` (``quant_algo``,
``ignore``, ``config_groups``). ``quant_algo: MIXED_PRECISION`` lists each quantized module in
``quantized_layers`` (``{"model.layers.3.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4",
"group_size": 16}, ...}``; ModelOpt ``export/quant_utils.py``, ``process_layer_quant_config``)."""

from __future__ import annotations

import torch

from moeshard.checkpoints.formats import MODELOPT_NAMES, QuantFormat, Scheme
from moeshard.errors import MoeshardError

#: The block size of NVFP4 (the only ``group_size`` ModelOpt writes for it).
GROUP_SIZE = 16


def _group_size(q: dict) -> int | None:
    if q.get("group_size") is not None:
        return q["group_size"]
    for group in (q.get("config_groups") or {}).values():  # config.json form: no top-level group_size
        gs = ((group or {}).get("weights") or {}).get("group_size")
        if gs is not None:
            return gs
    return None


def scheme(q: dict, where: str) -> Scheme:
    """The :class:`Scheme` of a ModelOpt quant config (the ``quantization`` object of
    hf_quant_config.json, or config.json's ``quantization_config``)."""
    algo = str(q.get("quant_algo")).upper()
    kv = q.get("kv_cache_quant_algo") or (q.get("kv_cache_scheme") or {}).get("type")
    if algo == "NVFP4":
        gs = _group_size(q)
        if gs not in (None, GROUP_SIZE):
            raise MoeshardError(f"{where}: group_size: expected {GROUP_SIZE} (NVFP4), found {gs!r}")
        exclude = q.get("exclude_modules") or q.get("ignore") or []
        return Scheme("modelopt", QuantFormat.NVFP4, MODELOPT_NAMES, exclude=tuple(exclude), kv_cache=kv)
    if algo == "MIXED_PRECISION":
        layers = q.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise MoeshardError(f"{where}: quantized_layers: expected the per-module algorithms of a MIXED_PRECISION "
                                f"export, found {layers!r}")
        algos = {}
        for module, info in layers.items():
            a = str((info or {}).get("quant_algo")).upper()
            if a == "NVFP4" and (info or {}).get("group_size", GROUP_SIZE) != GROUP_SIZE:
                raise MoeshardError(f"{where}: quantized_layers.{module}.group_size: expected {GROUP_SIZE} (NVFP4), "
                                    f"found {info.get('group_size')!r}")
            algos[module] = a
        return Scheme("modelopt", QuantFormat.NVFP4, MODELOPT_NAMES, layers=algos, kv_cache=kv)
    raise MoeshardError(f"{where}: quant_algo: expected NVFP4 or MIXED_PRECISION (ModelOpt FP4), found "
                        f"{q.get('quant_algo')!r}")


def read_scalar(ckpt, name: str) -> torch.Tensor:
    """A per-tensor F32 scale (``[]`` as ModelOpt writes it, ``[1]`` tolerated) as a 0-dim tensor."""
    t = ckpt.read(name).float().reshape(-1)
    if t.numel() != 1:
        raise MoeshardError(f"{ckpt.info(name).file}: {name}: expected one value, found {t.numel()}")
    return positive_finite(ckpt, name, t)[0]


def positive_finite(ckpt, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` (per-tensor scales of ``name``) if every value is positive and finite."""
    if not torch.isfinite(t).all() or (t <= 0).any():
        bad = t[~torch.isfinite(t) | (t <= 0)][0].item()
        raise MoeshardError(f"{ckpt.info(name).file}: {name}: expected a positive finite scale, found {bad}")
    return t
