"""Canonical experts <-> the FP4 layout of FlashInfer's trtllm-gen fused MoE.

Per expert, with ``epilogue_tile_m = 128`` (DESIGN.md, "trtllm-gen FP4 layout"):

- ``gemm1_weights``: w13 rows permuted by the gated-activation reorder (out[2k] = up k,
  out[2k+1] = gate k) followed by the row shuffle (out[32b + j] = in[32b + 4*(j%8) + j//8]);
- ``gemm1_weights_scale``: w13_scale rows by the same permutation, then the 128x4 interleave,
  labelled float8_e4m3fn (also MXFP4's UE8M0 bytes: the kernel infers the format from the size);
- ``gemm1_bias``: w13_bias by the same permutation, float32;
- ``gemm2_*``: the same without the gated reorder.

The row permutations come from FlashInfer's own index functions
(``get_reorder_rows_for_gated_act_gemm_row_indices``, ``get_shuffle_matrix_a_row_indices``),
composed once per shape and applied to all experts of a layer in one gather.
"""

from __future__ import annotations

import functools

import torch

from moeshard.layouts.canonical import CanonicalExperts
from moeshard.layouts.kernel import KERNEL_FIELDS
from moeshard.layouts.scales import deinterleave_scales_128x4, interleave_scales_128x4

LAYOUT_NAME = "trtllm-gen-fp4"
LAYOUT_VERSION = 1
EPILOGUE_TILE_M = 128
SCALE_DTYPE = torch.float8_e4m3fn


def flashinfer_version() -> str | None:
    """The installed flashinfer-python's version, or None (it is not needed to read artifacts)."""
    try:
        from importlib.metadata import version

        return version("flashinfer-python")
    except Exception:
        return None


def flashinfer_import_error(e: ImportError) -> Exception:
    """The MoeshardError for a FlashInfer whose layout index functions did not import."""
    from moeshard.errors import MoeshardError

    return MoeshardError(f"the trtllm-gen layout uses FlashInfer's index functions, which did not import ({e}): "
                         "pip install flashinfer-python==0.7.2.post1 (on a CPU-only machine add --no-deps, then "
                         "apache-tvm-ffi and the small packages the Makefile lists)")


@functools.lru_cache(maxsize=64)
def _row_permutation(rows: int, epilogue_tile_m: int, gated: bool) -> torch.Tensor:
    # FlashInfer's helpers only read the shape of their argument; a [rows, 1] stand-in suffices.
    try:
        from flashinfer.fused_moe.core import get_reorder_rows_for_gated_act_gemm_row_indices
        from flashinfer.utils import get_shuffle_matrix_a_row_indices
    except ImportError as e:
        raise flashinfer_import_error(e) from None

    probe = torch.empty(rows, 1, dtype=torch.uint8)
    shuffle = get_shuffle_matrix_a_row_indices(probe, epilogue_tile_m=epilogue_tile_m)
    if not gated:
        return shuffle
    # Same composition as FlashInfer's _maybe_get_cached_w3_w1_permute_indices: reorder, then shuffle.
    return get_reorder_rows_for_gated_act_gemm_row_indices(probe)[shuffle]


def gemm1_row_permutation(rows: int, epilogue_tile_m: int = EPILOGUE_TILE_M) -> torch.Tensor:
    """Row gather indices ``[rows]`` int64 for GEMM1 (``[up ; gate]`` rows, gated activation).

    ``out = w13[:, perm]``. Requires ``rows % 2 == 0`` and ``rows % 32 == 0`` (tile 128).
    Cached by ``(rows, epilogue_tile_m)``; callers must not modify the result.
    """
    return _row_permutation(rows, epilogue_tile_m, True)


def gemm2_row_permutation(rows: int, epilogue_tile_m: int = EPILOGUE_TILE_M) -> torch.Tensor:
    """Row gather indices ``[rows]`` int64 for GEMM2 (plain shuffle)."""
    return _row_permutation(rows, epilogue_tile_m, False)


def _gather_rows(t: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    return torch.index_select(t, 1, perm.to(t.device))


def to_trtllm(c: CanonicalExperts, epilogue_tile_m: int = EPILOGUE_TILE_M) -> dict[str, torch.Tensor]:
    """Rewrite (already padded) canonical experts into the trtllm-gen kernel tensors.

    Parameters
    ----------
    c : canonical experts with ``2*I % 128 == 0``, ``H % 128 == 0`` and ``H // sf``,
        ``I // sf`` multiples of 4, so that the 128x4 interleave adds no padding.

    Returns
    -------
    dict with ``gemm1_weights [E, 2*I, H // 2]`` uint8, ``gemm1_weights_scale [E, 2*I, H // sf]``
    float8_e4m3fn, ``gemm2_weights [E, H, I // 2]`` uint8, ``gemm2_weights_scale [E, H, I // sf]``
    float8_e4m3fn and, when c has biases, ``gemm1_bias [E, 2*I]`` / ``gemm2_bias [E, H]``
    float32. All new tensors on c's device.
    """
    return to_trtllm_padded(c, c.hidden_size, c.intermediate_size, epilogue_tile_m)


def gemm1_source_rows(rows: torch.Tensor | None, i: int, inter_pad: int,
                      epilogue_tile_m: int = EPILOGUE_TILE_M) -> torch.Tensor:
    """For each GEMM1 kernel row: its row in the source, or -1 (a zero row of padding).

    ``rows [2*i]`` int64 gives the source row of each canonical ``[up ; gate]`` row (None: the
    source is canonical). The kernel rows are those of the canonical rows padded per half to
    ``inter_pad``, permuted by :func:`gemm1_row_permutation`. Returns ``[2 * inter_pad]`` int64.
    """
    p = gemm1_row_permutation(2 * inter_pad, epilogue_tile_m)
    half, k = p // inter_pad, p % inter_pad
    c = torch.where(k < i, half * i + k, 0)
    return torch.where(k < i, c if rows is None else rows[c], -1)


def gemm2_source_rows(rows: torch.Tensor | None, h: int, hidden_pad: int,
                      epilogue_tile_m: int = EPILOGUE_TILE_M) -> torch.Tensor:
    """Like :func:`gemm1_source_rows` for GEMM2: ``rows [h]`` (or None), rows padded to
    ``hidden_pad`` and permuted by :func:`gemm2_row_permutation`. Returns ``[hidden_pad]`` int64."""
    p = gemm2_row_permutation(hidden_pad, epilogue_tile_m)
    c = torch.where(p < h, p, 0)
    return torch.where(p < h, c if rows is None else rows[c], -1)


def _wide(t: torch.Tensor, *more: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of tensors whose last dims hold the same bytes, as the widest integer type they all
    allow (a row copy then moves 8 bytes per element instead of 1)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return tuple(x.view(torch.uint8).view(dtype) if x.dtype.itemsize == 1 else x.view(dtype)
                         for x in (t, *more))
        except RuntimeError:
            continue
    return (t, *more)


def gather_rows(src: torch.Tensor, rows: torch.Tensor, cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per expert, ``out[e, q, :C] = src[e, rows[q], :C]`` (zero where ``rows[q] == -1``) and
    ``out[e, q, C:cols] = 0``.

    Parameters
    ----------
    src : ``[n, R, C]`` (any dtype, any strides with a unit last stride), or ``[n, R]``
        (one element per row; then ``cols`` must be 1 and ``out`` is ``[n, Rout]``)
    rows : ``[Rout]`` int64 in ``[-1, R)``
    cols : ``C`` or more (column padding)
    out : optional ``[n, Rout, cols]`` of ``src``'s dtype (e.g. a file's staging buffer)

    One row copy per output row: when the zero rows all come last (any sizes where padding
    stays a multiple of 32 rows), each expert is one ``index_select`` straight into ``out`` (on a
    GPU, one batched gather).
    """
    flat = src.dim() == 2
    s = src.unsqueeze(-1) if flat else src
    n, c = s.shape[0], s.shape[2]
    if out is None:
        out = torch.empty((n, len(rows)) if flat else (n, len(rows), cols), dtype=src.dtype, device=src.device)
    o = out.unsqueeze(-1) if flat else out
    rows = rows.to(src.device)
    valid = rows >= 0
    a = int(valid.sum())
    if cols > c:
        o[:, :, c:].zero_()
    if bool(valid[:a].all()):
        o[:, a:].zero_()
        if src.device.type != "cpu":  # one batched gather (a temporary is cheap on a GPU)
            o[:, :a, :c] = s.index_select(1, rows[:a])
            return out
        s2, o2 = _wide(s, o[:, :a, :c])
        for e in range(n):
            torch.index_select(s2[e], 0, rows[:a], out=o2[e])
    else:
        o[:, ~valid] = 0
        o[:, valid, :c] = s[:, rows[valid]]
    return out


def trtllm_tensor(kind: str, src: torch.Tensor, rows: torch.Tensor | None, hidden_pad: int, inter_pad: int,
                  sf: int, epilogue_tile_m: int = EPILOGUE_TILE_M, out: torch.Tensor | None = None,
                  gemm2_rows: int | None = None) -> torch.Tensor:
    """One kernel tensor of n experts (``kind`` a key of :data:`KERNEL_FIELDS`), padded and permuted.

    Parameters
    ----------
    src : the canonical field of the experts (``w13 [n, 2*I, H // 2]`` etc., see
        :class:`CanonicalExperts`), or a source tensor whose rows ``rows`` are it: ``src[:, rows]``
        is the canonical field (a checkpoint's own row order, or a TP slice, read in place)
    rows : ``[2*I]`` (GEMM1) or ``[H]`` (GEMM2) int64, or None
    hidden_pad, inter_pad : padded H and I; sf : 32 (MXFP4) or 16 (NVFP4)
    out : optional destination of the result's shape and dtype
    gemm2_rows : GEMM2's rows (:func:`~moeshard.layouts.kernel.gemm2_rows`), default ``hidden_pad``;
        fewer (roundUp(H, 128)) in the "trimmed" hidden padding

    Returns the kernel tensor: ``gemm1_weights [n, 2*inter_pad, hidden_pad // 2]`` uint8,
    ``gemm1_weights_scale [n, 2*inter_pad, hidden_pad // sf]`` float8_e4m3fn (128x4 interleaved),
    ``gemm1_bias [n, 2*inter_pad]`` float32, and the GEMM2 ones with ``[n, gemm2_rows, ...]``.
    """
    gemm1 = kind.startswith("gemm1")
    rows = None if rows is None else rows.cpu()  # row maps are built on the CPU, moved once by gather_rows
    r = len(rows) if rows is not None else src.shape[1]
    if gemm1:
        i = r // 2
        if inter_pad < i or inter_pad % sf:
            raise ValueError(f"cannot pad I={i} to {inter_pad} (block {sf})")
        src_rows = gemm1_source_rows(rows, i, inter_pad, epilogue_tile_m)
    else:
        n2 = hidden_pad if gemm2_rows is None else gemm2_rows
        if n2 < r or n2 % sf:
            raise ValueError(f"cannot pad H={r} to {n2} (block {sf})")
        src_rows = gemm2_source_rows(rows, r, n2, epilogue_tile_m)
    k = hidden_pad if gemm1 else inter_pad  # the reduced dimension: H for GEMM1, I for GEMM2
    if kind.endswith("bias"):
        return gather_rows(src.float(), src_rows, 1, out)
    if kind.endswith("weights"):
        return gather_rows(src, src_rows, k // 2, None if out is None else out.view(torch.uint8))
    if len(src_rows) % 128 or (k // sf) % 4:
        raise ValueError(f"{kind} [{len(src_rows)}, {k // sf}] needs rows % 128 == 0 and cols % 4 == 0")
    linear = gather_rows(src.view(torch.uint8), src_rows, k // sf)
    return interleave_scales_128x4(linear, None if out is None else out.view(torch.uint8)).view(SCALE_DTYPE)


def to_trtllm_padded(c: CanonicalExperts, hidden_pad: int, inter_pad: int,
                     epilogue_tile_m: int = EPILOGUE_TILE_M, gemm2_rows: int | None = None) -> dict[str, torch.Tensor]:
    """``to_trtllm(pad_experts(c, hidden_pad, inter_pad))`` with padding and permutation composed
    into one row map per tensor (:func:`trtllm_tensor`): one copy per byte. Same outputs, same
    preconditions as the two functions it fuses; ``gemm2_rows`` (default ``hidden_pad``) gives
    GEMM2 fewer rows than GEMM1's K (the "trimmed" hidden padding)."""
    return {kind: trtllm_tensor(kind, getattr(c, field), None, hidden_pad, inter_pad, c.sf_vec_size, epilogue_tile_m,
                                gemm2_rows=gemm2_rows)
            for kind, field in KERNEL_FIELDS.items() if getattr(c, field) is not None}


def from_trtllm(t: dict[str, torch.Tensor], epilogue_tile_m: int = EPILOGUE_TILE_M) -> CanonicalExperts:
    """Read kernel tensors back the way the kernel does: inverse interleave, inverse permutation.

    The inverse of :func:`to_trtllm` (padded canonical experts). For NVFP4, also what the kernel
    scalars (:func:`~moeshard.layouts.kernel.nvfp4_scalars`) apply: ``w1_scale_2``,
    ``w3_scale_2``, ``w2_scale_2`` ``[E]`` float32 (see below).
    """
    w1, w2 = t["gemm1_weights"], t["gemm2_weights"]
    two_i, h = w1.shape[1], w2.shape[1]
    inv1 = torch.argsort(gemm1_row_permutation(two_i, epilogue_tile_m))
    inv2 = torch.argsort(gemm2_row_permutation(h, epilogue_tile_m))
    s1, s2 = t["gemm1_weights_scale"], t["gemm2_weights_scale"]
    s1 = deinterleave_scales_128x4(s1.view(torch.uint8), s1.shape[1], s1.shape[2])
    s2 = deinterleave_scales_128x4(s2.view(torch.uint8), s2.shape[1], s2.shape[2])
    b1, b2 = t.get("gemm1_bias"), t.get("gemm2_bias")
    c = CanonicalExperts(
        w13=_gather_rows(w1.view(torch.uint8), inv1),
        w13_scale=_gather_rows(s1, inv1),
        w2=_gather_rows(w2.view(torch.uint8), inv2),
        w2_scale=_gather_rows(s2, inv2),
        w13_bias=None if b1 is None else _gather_rows(b1, inv1),
        w2_bias=None if b2 is None else _gather_rows(b2, inv2),
    )
    if "output1_scale_gate_scalar" not in t:
        return c
    # NVFP4: the factors the kernel applies to each GEMM's output, relative to unquantized
    # activations (the hidden states are quantized with 1/a13): gate a13*s1 / a13, up
    # a13*s3/a2 / a13, down a2*s2. Only the up path's product s3/a2 * a2*s2 is meaningful there
    # (the kernel never sees a2 alone); where gate and up share a scale, a2 is their ratio.
    gate, o1, o2 = t["output1_scale_gate_scalar"], t["output1_scale_scalar"], t["output2_scale_scalar"]
    a13 = 1.0 / t["hidden_states_scale_global"].float()
    return c.replace(w1_scale_2=gate / a13, w3_scale_2=o1 / a13, w2_scale_2=o2)
