"""Checkpoint families: one adapter per family behind the protocol of :mod:`.base`.

Adding a family: write ``families/<name>.py`` with an adapter class (names, quirks, config
checks; canonical fields out), add its :class:`~.base.Family` member and one line to
:data:`ADAPTERS`. Nothing outside ``checkpoints/`` names a family.
"""

from __future__ import annotations

from moeshard.checkpoints.families.base import (
    ROW_FIELDS,
    Adapter,
    Family,
    ModelSpec,
    check_sizes,
    expert_index,
    expert_runs,
    needed_rows,
    needed_tensors,
    read_experts,
    read_rank_experts,
)
from moeshard.checkpoints.families.deepseek import DeepSeekAdapter
from moeshard.checkpoints.families.gpt_oss import GptOssAdapter
from moeshard.checkpoints.families.llama4 import Llama4Adapter
from moeshard.errors import MoeshardError

#: Every family, in detection order.
ADAPTERS: dict[Family, Adapter] = {
    Family.GPT_OSS: GptOssAdapter(),
    Family.DEEPSEEK: DeepSeekAdapter(),
    Family.LLAMA4: Llama4Adapter(),
}


def detect_config(config: dict, quant_config: dict | None, where) -> Adapter:
    """The adapter whose family matches config.json (and hf_quant_config.json), or a MoeshardError."""
    for adapter in ADAPTERS.values():
        if adapter.detect(config, quant_config):
            return adapter
    mt = config.get("model_type")
    qm = (config.get("quantization_config") or {}).get("quant_method")
    raise MoeshardError(
        f"{where}: unsupported checkpoint: expected gpt_oss (mxfp4), deepseek_v3 or llama4 "
        f"(ModelOpt NVFP4), found model_type {mt!r} with quant_method {qm!r}"
    )


def detect(ckpt) -> Adapter:
    """The adapter of a :class:`~moeshard.checkpoints.source.Checkpoint`, or a MoeshardError."""
    return detect_config(ckpt.config, ckpt.quant_config, ckpt.root / "config.json")


__all__ = ["ADAPTERS", "ROW_FIELDS", "Adapter", "Family", "ModelSpec", "check_sizes", "detect", "detect_config",
           "expert_index", "expert_runs", "needed_rows", "needed_tensors", "read_experts", "read_rank_experts"]
