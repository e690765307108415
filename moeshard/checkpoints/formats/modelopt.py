"""NVIDIA ModelOpt's NVFP4 export, as every ModelOpt family writes it: per Linear (or per fused
expert tensor) ``weight`` U8 ``[N, K/2]`` (low nibble = even element), ``weight_scale`` F8_E4M3
``[N, K/16]``, ``weight_scale_2`` F32 (amax / (6 * 448)) and ``input_scale`` F32 (calibration
amax / (6 * 448)); the quant config in ``hf_quant_config.json`` (legacy) or in config.json's
``quantization_config`` with ``quant_method: modelopt``."""

from __future__ import annotations

import torch

from moeshard.errors import MoeshardError

#: The block size of NVFP4 (the only ``group_size`` ModelOpt writes for it).
GROUP_SIZE = 16


def nvfp4_quant_algo(config: dict, quant_config: dict | None) -> str | None:
    """``NVFP4`` from hf_quant_config.json (legacy ModelOpt) or config.json's modelopt quantization_config."""
    if quant_config is not None:
        return (quant_config.get("quantization") or {}).get("quant_algo")
    q = config.get("quantization_config") or {}
    return q.get("quant_algo") if q.get("quant_method") == "modelopt" else None


def check_group_size(ckpt) -> None:
    """Refuse an hf_quant_config.json whose ``group_size`` is not NVFP4's 16."""
    q = (ckpt.quant_config or {}).get("quantization") or {}
    gs = q.get("group_size", GROUP_SIZE)
    if gs != GROUP_SIZE:
        raise MoeshardError(f"{ckpt.root / 'hf_quant_config.json'}: group_size: expected {GROUP_SIZE} (NVFP4), "
                            f"found {gs!r}")


def read_scalar(ckpt, name: str) -> torch.Tensor:
    """A per-tensor F32 scale (``[]`` as ModelOpt writes it, ``[1]`` tolerated) as a 0-dim tensor."""
    t = ckpt.read(name).float().reshape(-1)
    if t.numel() != 1:
        raise MoeshardError(f"{ckpt.info(name).file}: {name}: expected one value, found {t.numel()}")
    if not torch.isfinite(t).all() or t.item() <= 0:
        raise MoeshardError(f"{ckpt.info(name).file}: {name}: expected a positive finite scale, found {t.item()}")
    return t[0]
