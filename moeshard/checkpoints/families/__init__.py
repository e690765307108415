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
from moeshard.checkpoints.families.qwen3_moe import Qwen3MoeAdapter
from moeshard.checkpoints.formats import QuantFormat, detect_scheme
from moeshard.errors import MoeshardError

#: Every family, in detection order.
ADAPTERS: dict[Family, Adapter] = {
    Family.GPT_OSS: GptOssAdapter(),
    Family.DEEPSEEK: DeepSeekAdapter(),
    Family.QWEN3_MOE: Qwen3MoeAdapter(),
    Family.LLAMA4: Llama4Adapter(),
}
#: What the families convert, for the refusals.
SUPPORTED = ("gpt_oss (MXFP4), deepseek_v3 / kimi_k2 / kimi_k25, qwen3_moe and llama4 (NVFP4 from ModelOpt or "
             "compressed-tensors)")


def detect_config(config: dict, quant_config: dict | None, root) -> Adapter:
    """The adapter of a checkpoint's family and quantization (config.json, hf_quant_config.json;
    ``root``: the folder, for messages), or a one-line MoeshardError saying what was found and
    what is supported."""
    where = f"{root}/config.json"
    adapter = next((a for a in ADAPTERS.values() if a.detect(config)), None)
    if adapter is None:
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        mt = config.get("model_type") if not text else f"{config.get('model_type')}/{text.get('model_type')}"
        raise MoeshardError(f"{where}: unsupported checkpoint: found model_type {mt!r}; supported: {SUPPORTED}")
    scheme = detect_scheme(config, quant_config, root)
    if not adapter.accepts(scheme):
        why = ("MXFP4 from another exporter than OpenAI's GPT-OSS release" if scheme.format is QuantFormat.MXFP4
               else "not its MXFP4 release")
        raise MoeshardError(f"{where}: unsupported checkpoint: {adapter.family.value} quantized as {scheme.exporter} "
                            f"{scheme.format.value}: {why}; supported: {SUPPORTED}")
    return adapter


def detect(ckpt) -> Adapter:
    """The adapter of a :class:`~moeshard.checkpoints.source.Checkpoint`, or a MoeshardError."""
    return detect_config(ckpt.config, ckpt.quant_config, ckpt.root)


__all__ = ["ADAPTERS", "ROW_FIELDS", "Adapter", "Family", "ModelSpec", "check_sizes", "detect", "detect_config",
           "expert_index", "expert_runs", "needed_rows", "needed_tensors", "read_experts", "read_rank_experts"]
