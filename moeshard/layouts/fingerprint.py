"""The layout fingerprint: per kernel tensor kind, the SHA-256 of the indices that define its
trtllm-gen FP4 layout for one artifact's shapes, as the installed FlashInfer defines them.

An artifact records it; :func:`moeshard.load_rank` and ``validate`` recompute it from the
installed FlashInfer (milliseconds) and take any FlashInfer version that lays the tensors out
the same way. What is hashed, per kind (:data:`~moeshard.layouts.kernel.KERNEL_FIELDS` keys):

- the row permutation, from the index functions FlashInfer's own preparation
  (``prepare_trtllm_fp4_weights``) and the engines call, ``epilogue_tile_m`` as recorded:
  ``_maybe_get_cached_w3_w1_permute_indices`` (GEMM1: gated reorder, then row shuffle) and
  ``get_w2_permute_indices_with_cache`` (GEMM2: row shuffle), both in
  ``flashinfer/fused_moe/core.py``; for the block scales with ``num_elts_per_sf=16``, as
  ``prepare_trtllm_fp4_weights`` passes for MXFP4 and NVFP4 alike;
- for the block scales also the 128x4 interleave: the flat offset, within one expert's buffer,
  of every (row, column) of the linear scales. FlashInfer's ``block_scale_interleave`` is
  CUDA-only, so the offsets come from its pure-torch reading of that layout,
  ``flashinfer.trace.templates.gemm._unswizzle_batched_sf_128x4`` (the function its trtllm-gen
  MoE reference, ``trace/templates/moe.py``, reads the kernel's weight scales with), applied to
  ``arange``. That the CUDA kernel writes this layout is proven on the GPU
  (``tests/gpu/test_block_scale_interleave.py``).

Bytes hashed: ``"{kind} rows={R}"`` (and ``" cols={C}"`` for scales) ``" epilogue_tile_m={t}\\n"``
in ASCII, the permutation ``[R]`` as int64 little-endian, then (scales) the offsets ``[R, C]``
row-major as int64 little-endian.
"""

from __future__ import annotations

import hashlib

import torch

from moeshard.errors import MoeshardError
from moeshard.layouts.kernel import KERNEL_FIELDS, KERNEL_TENSORS
from moeshard.layouts.scales import interleave_scales_128x4
from moeshard.layouts.trtllm import flashinfer_import_error, gemm1_row_permutation, gemm2_row_permutation

#: ``num_elts_per_sf`` of the scale permutations (``prepare_trtllm_fp4_weights``: 16 for both formats).
SCALE_PERMUTE_ELTS_PER_SF = 16


def kind_shape(kind: str, hidden_pad: int, gemm2_rows: int, inter_pad: int, sf: int) -> tuple[int, int | None]:
    """(rows, scale columns or None) of one expert's tensor of ``kind`` (:data:`KERNEL_TENSORS`)."""
    shape = next(t for t in KERNEL_TENSORS if t.name == kind).shape(1, hidden_pad, gemm2_rows, inter_pad, sf)
    return shape[1], (shape[2] if kind.endswith("_scale") else None)


def flashinfer_indices(kind: str, rows: int, cols: int | None, epilogue_tile_m: int) -> list[torch.Tensor]:
    """The installed FlashInfer's row permutation ``[rows]`` of ``kind`` and, for scales, its
    128x4 offsets ``[rows, cols]`` (int64, CPU)."""
    try:
        from flashinfer.fused_moe import core
        from flashinfer.trace.templates.gemm import _unswizzle_batched_sf_128x4
    except ImportError as e:
        raise flashinfer_import_error(e) from None
    scale = cols is not None
    probe = torch.empty(rows, 1, dtype=torch.uint8)  # the functions read only the shape (and dtype)
    permute = core._maybe_get_cached_w3_w1_permute_indices if kind.startswith("gemm1") else \
        core.get_w2_permute_indices_with_cache
    out = [permute({}, probe, epilogue_tile_m, num_elts_per_sf=SCALE_PERMUTE_ELTS_PER_SF if scale else None).cpu()]
    if scale:
        padded = -(-rows // 128) * 128 * (-(-cols // 4) * 4)
        out.append(_unswizzle_batched_sf_128x4(torch.arange(padded), 1, rows, cols)[0])
    return out


def moeshard_indices(kind: str, rows: int, cols: int | None, epilogue_tile_m: int) -> list[torch.Tensor]:
    """The same indices as :func:`flashinfer_indices`, read off moeshard's own transform (its row
    permutations and :func:`interleave_scales_128x4`, which place every byte the converter writes)."""
    perm = (gemm1_row_permutation if kind.startswith("gemm1") else gemm2_row_permutation)(rows, epilogue_tile_m)
    if cols is None:
        return [perm]
    n = rows * cols  # byte b of (index + 1) in plane b; 0 = padding
    idx = torch.arange(1, n + 1).view(1, rows, cols)
    planes = [interleave_scales_128x4(((idx >> (8 * b)) & 255).to(torch.uint8)).reshape(-1).long()
              for b in range((n.bit_length() + 7) // 8)]
    src = sum(p << (8 * b) for b, p in enumerate(planes))
    where = src.nonzero().squeeze(1)
    offsets = torch.full((n,), -1, dtype=torch.long)
    offsets[src[where] - 1] = where
    return [perm, offsets.view(rows, cols)]


def kind_fingerprint(kind: str, indices: list[torch.Tensor], rows: int, cols: int | None, epilogue_tile_m: int) -> str:
    """SHA-256 (hex) of one kind's indices, as the module docstring says."""
    h = hashlib.sha256(f"{kind} rows={rows}{'' if cols is None else f' cols={cols}'} "
                       f"epilogue_tile_m={epilogue_tile_m}\n".encode("ascii"))
    for t in indices:
        h.update(t.to(torch.int64).contiguous().numpy().astype("<i8", copy=False))
    return h.hexdigest()


def layout_fingerprint(kinds, hidden_pad: int, gemm2_rows: int, inter_pad: int, sf: int, epilogue_tile_m: int,
                       check_moeshard: bool = False) -> dict[str, str]:
    """``{kind: sha256}`` for the kernel tensor kinds ``kinds`` (keys of :data:`KERNEL_FIELDS`) of
    an artifact with padded H ``hidden_pad``, GEMM2 rows ``gemm2_rows``, padded I ``inter_pad`` and
    scale block ``sf``, from the installed FlashInfer.

    ``check_moeshard`` (conversion): first refuse, with a MoeshardError naming the kind, a
    FlashInfer whose layout differs from the one moeshard writes, so that no artifact records a
    fingerprint its bytes do not have.
    """
    out = {}
    for kind in [k for k in KERNEL_FIELDS if k in kinds]:
        rows, cols = kind_shape(kind, hidden_pad, gemm2_rows, inter_pad, sf)
        fi = flashinfer_indices(kind, rows, cols, epilogue_tile_m)
        if check_moeshard and not all(torch.equal(a, b) for a, b in
                                      zip(fi, moeshard_indices(kind, rows, cols, epilogue_tile_m), strict=True)):
            from moeshard.layouts.trtllm import LAYOUT_NAME, LAYOUT_VERSION, flashinfer_version

            raise MoeshardError(f"{kind}: the installed flashinfer-python {flashinfer_version()} lays it out "
                                f"otherwise than this moeshard's {LAYOUT_NAME} version {LAYOUT_VERSION} "
                                f"([{rows}{'' if cols is None else f', {cols}'}] per expert); use a moeshard made "
                                "for this FlashInfer")
        out[kind] = kind_fingerprint(kind, fi, rows, cols, epilogue_tile_m)
    return out
