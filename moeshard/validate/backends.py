"""Choosing the validation backend, and the trtllm-gen kernel call (Blackwell only).

``trtllm-gen`` runs FlashInfer's ``trtllm_fp4_block_scale_moe`` on the artifact's own tensors
with the manifest's arguments; it exists only on SM100/SM103, so elsewhere ``auto`` picks
``decode`` (which reads the artifact the way the kernel does) and says so.
"""

from __future__ import annotations

import torch

from moeshard.checkpoints.formats.fp4 import dequantize_nvfp4, quantize_nvfp4
from moeshard.errors import MoeshardError
from moeshard.layouts.kernel import static_kernel_args

BLACKWELL = ((10, 0), (10, 3))


def gpu_description() -> tuple[str, tuple[int, int] | None]:
    """('NVIDIA H200 (SM90)', (9, 0)), or ('no CUDA GPU', None)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU", None
    cap = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (SM{cap[0]}{cap[1]})", cap


def select_backend(requested: str, device: str) -> tuple[str, str | None]:
    """The backend to run and a note for the report (why auto chose decode), or a MoeshardError."""
    if requested not in ("auto", "decode", "trtllm-gen"):
        raise MoeshardError(f"--backend {requested}: expected auto, trtllm-gen or decode")
    if device not in ("cpu", "cuda"):
        raise MoeshardError(f"--device {device}: expected cpu or cuda")
    found, cap = gpu_description()
    if device == "cuda" and cap is None:
        raise MoeshardError("--device cuda: no CUDA GPU found")
    if requested == "decode":
        return "decode", None
    if cap in BLACKWELL:
        return "trtllm-gen", None
    if requested == "trtllm-gen":
        raise MoeshardError(f"--backend trtllm-gen: FlashInfer's trtllm-gen MoE kernels run on Blackwell "
                            f"(SM100/SM103) only; found {found}. Use --backend decode")
    return "decode", (f"backend auto: {found}, not Blackwell (SM100/SM103), so the trtllm-gen kernel cannot "
                      "run here; decode reads the artifact the way the kernel does and runs the same MoE math")


def quantize_hidden_states(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 activations for the kernel: ``x [T, H]`` -> ``(packed [T, H/2] uint8, scale [T, H/16]
    float8_e4m3fn linear, dequantized [T, H] float32)``; block scale = amax/6 * global_scale.

    The reference MoE runs on the dequantized values, so the kernel and the reference see the
    same activations.
    """
    scale_2 = 1.0 / global_scale.float()
    packed, sf, _ = quantize_nvfp4(x, scale_2)
    return packed, sf, dequantize_nvfp4(packed, sf, scale_2)


def trtllm_args(kt: dict[str, torch.Tensor], kernel_args: dict, rank: dict, hidden: torch.Tensor,
                logits: torch.Tensor, routing_bias: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    """Keyword arguments of ``flashinfer.fused_moe.trtllm_fp4_block_scale_moe`` for one rank and
    layer, and the activations ``[T, H_pad]`` float32 the reference must use for a fair comparison.

    Parameters
    ----------
    kt : the rank's layer tensors (leaf names = FlashInfer's parameter names)
    kernel_args : the manifest's ``kernel_args`` of the layer
    rank : the manifest's entry of the rank (``local_expert_offset``, ``local_num_experts``)
    hidden : ``[T, H_pad]`` float32 hidden states, zero-padded to the artifact's hidden size
    logits : ``[T, num_experts]`` float32 router logits
    routing_bias : ``[num_experts]`` (DeepSeek's e_score_correction_bias) or None

    MXFP4 (GPT-OSS) runs with BF16 activations; NVFP4 with NVFP4 activations quantized with the
    artifact's ``hidden_states_scale_global`` (linear scale layout). Logits and the routing bias
    stay float32 (the launcher takes f32 or bf16 for every routing method), so that the kernel
    routes exactly as the reference does. With the "trimmed" hidden padding ``kernel_args`` holds
    ``valid_hidden_size`` and the kernel's output is that wide.
    """
    nvfp4 = "output1_scale_scalar" in kt
    args = static_kernel_args(kt, kernel_args, rank)
    args.update(routing_logits=logits.float(),
                routing_bias=None if routing_bias is None else routing_bias.float())
    if nvfp4:
        packed, sf, deq = quantize_hidden_states(hidden, kt["hidden_states_scale_global"])
        args.update(hidden_states=packed, hidden_states_scale=sf)
        return args, deq
    bf = hidden.to(torch.bfloat16)
    args.update(hidden_states=bf, hidden_states_scale=None)
    return args, bf.float()


def run_trtllm(args: dict) -> torch.Tensor:
    """One call of the kernel; returns the output ``[T, H_pad]`` float32 (``[T, valid_hidden_size]``
    with the "trimmed" hidden padding)."""
    from flashinfer.fused_moe import trtllm_fp4_block_scale_moe

    return trtllm_fp4_block_scale_moe(**args)[0].float()
