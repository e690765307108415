"""Pure tensor functions: canonical experts <-> FlashInfer trtllm-gen kernel layout, the 128x4
scale interleave, the TP cut, and the kernel's tensors, scalars and static arguments.

Nothing here touches files, families or devices beyond the tensors it is given.
"""

from moeshard.layouts.canonical import CanonicalExperts, pad_experts
from moeshard.layouts.kernel import KERNEL_TENSORS, ActivationType, RoutingMethod
from moeshard.layouts.scales import deinterleave_scales_128x4, interleave_scales_128x4
from moeshard.layouts.trtllm import (
    EPILOGUE_TILE_M,
    LAYOUT_NAME,
    LAYOUT_VERSION,
    from_trtllm,
    gemm1_row_permutation,
    gemm2_row_permutation,
    to_trtllm,
)

__all__ = [
    "EPILOGUE_TILE_M",
    "KERNEL_TENSORS",
    "LAYOUT_NAME",
    "LAYOUT_VERSION",
    "ActivationType",
    "CanonicalExperts",
    "RoutingMethod",
    "deinterleave_scales_128x4",
    "from_trtllm",
    "gemm1_row_permutation",
    "gemm2_row_permutation",
    "interleave_scales_128x4",
    "pad_experts",
    "to_trtllm",
]
