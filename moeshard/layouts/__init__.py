"""Pure tensor functions: canonical experts <-> FlashInfer trtllm-gen kernel layout.

Nothing here touches files, families or devices beyond the tensors it is given.
"""

from moeshard.layouts.canonical import CanonicalExperts, pad_experts
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
    "CanonicalExperts",
    "EPILOGUE_TILE_M",
    "LAYOUT_NAME",
    "LAYOUT_VERSION",
    "deinterleave_scales_128x4",
    "from_trtllm",
    "gemm1_row_permutation",
    "gemm2_row_permutation",
    "interleave_scales_128x4",
    "pad_experts",
    "to_trtllm",
]
