"""The tensor-parallel cut of the experts' intermediate dimension, written once: which slice each
TP rank owns, and which rows (GEMM1) and columns (GEMM2) of a canonical field that slice is."""

from __future__ import annotations

import torch


def tp_slices(intermediate: int, sf: int, tp_size: int, ceil_blocks: bool) -> list[tuple[int, int]]:
    """Each TP rank's ``[start, stop)`` of the intermediate dimension, cut on ``sf``-element scale
    blocks, or ``[]`` when some rank would be empty or cut a block.

    ``ceil_blocks`` (MXFP4) follows vLLM's ``GptOssModel._load_weights_mxfp4``: per-rank I =
    ceil(I / sf / T) * sf, the last rank shorter. Otherwise (NVFP4) vLLM's FusedMoE weight loader:
    I / T each, which must be a whole number of blocks.
    """
    i = intermediate
    if tp_size > i // sf:  # no rank can own less than one block
        return []
    if ceil_blocks:
        per = -(-i // sf // tp_size) * sf
    else:
        per = i // tp_size if i % tp_size == 0 and (i // tp_size) % sf == 0 else 0
    out = [(min(r * per, i), min((r + 1) * per, i)) for r in range(tp_size)]
    return out if per and all(b > a for a, b in out) else []


def gemm1_rows(intermediate: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``[up[start:stop] ; gate[start:stop]]`` of a ``[.., 2 * intermediate, ..]`` GEMM1 field
    (weights, scales, bias), as int64 indices."""
    return torch.cat((torch.arange(start, stop), torch.arange(intermediate + start, intermediate + stop)))


def gemm2_columns(start: int, stop: int, per_column: int) -> slice:
    """Stored columns of a GEMM2 field holding elements ``[start, stop)``: ``per_column`` elements
    per stored column (2 for packed FP4 bytes, sf for block scales)."""
    return slice(start // per_column, stop // per_column)
