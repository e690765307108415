"""The static arguments of FlashInfer's ``trtllm_fp4_block_scale_moe`` for one rank and layer.

Shared by :func:`moeshard.load_rank` (serving) and the trtllm-gen validation backend.
"""

from __future__ import annotations

import torch

#: The artifact's tensor leaves, by FlashInfer parameter name (absent ones are passed as None).
TENSOR_ARGS = ("gemm1_weights", "gemm1_weights_scale", "gemm1_bias", "gemm1_alpha", "gemm1_beta",
               "gemm1_clamp_limit", "gemm2_weights", "gemm2_weights_scale", "gemm2_bias", "output1_scale_scalar",
               "output1_scale_gate_scalar", "output2_scale_scalar")


def flashinfer_version() -> str | None:
    """The installed flashinfer-python's version, or None (it is not needed to read artifacts)."""
    try:
        from importlib.metadata import version

        return version("flashinfer-python")
    except Exception:
        return None


def static_kernel_args(tensors: dict[str, torch.Tensor], kernel_args: dict, rank: dict) -> dict:
    """Every argument of ``trtllm_fp4_block_scale_moe`` that does not depend on the tokens.

    Parameters
    ----------
    tensors : the rank's tensors of one layer, keyed by FlashInfer parameter name
    kernel_args : the manifest's ``kernel_args`` of the layer
    rank : the manifest's entry of the rank

    The caller adds ``routing_logits`` ``[T, num_experts]`` (f32 or bf16), ``routing_bias``
    (DeepSeek: ``e_score_correction_bias``), ``hidden_states`` (bf16 ``[T, hidden_size]`` for
    MXFP4; NVFP4 packed ``[T, hidden_size/2]`` uint8 quantized with
    ``hidden_states_scale_global``) and ``hidden_states_scale``.
    """
    if rank.get("local_expert_offset") is None:
        raise ValueError("round-robin ranks have no local_expert_offset: the trtllm-gen kernel needs contiguous experts")
    args = {name: tensors.get(name) for name in TENSOR_ARGS}
    args.update(num_experts=kernel_args["num_experts"], top_k=kernel_args["top_k"], n_group=kernel_args.get("n_group"),
                topk_group=kernel_args.get("topk_group"), intermediate_size=kernel_args["intermediate_size"],
                local_expert_offset=rank["local_expert_offset"], local_num_experts=rank["local_num_experts"],
                routed_scaling_factor=kernel_args.get("routed_scaling_factor"),
                routing_method_type=kernel_args["routing_method_type"],
                activation_type=kernel_args.get("activation_type", 3), do_finalize=True)
    return args
