"""Canonical experts: the seam between checkpoint adapters and kernel layouts (DESIGN.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeshard.layouts.tp import gemm1_rows, gemm2_columns


@dataclass(frozen=True)
class CanonicalExperts:
    """The experts of one MoE layer that one rank owns, in one family-neutral form.

    E = local experts, H = hidden size, I = intermediate size, sf = 32 (MXFP4) or 16 (NVFP4).

    Attributes
    ----------
    w13 : ``[E, 2*I, H // 2]`` uint8
        Packed E2M1, low nibble = even element. Rows ``[up (w3) ; gate (w1)]``.
    w13_scale : ``[E, 2*I, H // sf]`` uint8
        MXFP4: UE8M0 bytes; NVFP4: E4M3 bytes. Row-major ("linear") layout.
    w2 : ``[E, H, I // 2]`` uint8
    w2_scale : ``[E, H, I // sf]`` uint8
    w13_bias, w2_bias : ``[E, 2*I]``, ``[E, H]`` float32, or None (GPT-OSS only).
    w1_scale_2, w3_scale_2, w2_scale_2 : ``[E]`` float32 or None
        NVFP4 per-tensor weight scale (``weight_scale_2``) of gate (w1), up (w3) and down (w2);
        gate and up may differ. Read back from an artifact (:func:`from_trtllm`) they are the
        factors the kernel applies relative to unquantized activations, whose product along the
        up path (``w3_scale_2 * w2_scale_2``) is what the source's is.
    w13_input_scale, w2_input_scale : ``[E]`` float32 or None
        NVFP4 activation scale (``input_scale``).
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    w1_scale_2: torch.Tensor | None = None
    w3_scale_2: torch.Tensor | None = None
    w2_scale_2: torch.Tensor | None = None
    w13_input_scale: torch.Tensor | None = None
    w2_input_scale: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def sf_vec_size(self) -> int:
        return 2 * self.w13.shape[2] // self.w13_scale.shape[2]

    def replace(self, **changes) -> CanonicalExperts:
        return dataclasses.replace(self, **changes)


def slice_intermediate(c: CanonicalExperts, start: int, stop: int) -> CanonicalExperts:
    """A TP rank's slice ``[start, stop)`` of every expert's intermediate dimension.

    ``w13`` keeps rows ``[up[start:stop] ; gate[start:stop]]`` (and so do its scales and bias);
    ``w2`` keeps columns ``[start, stop)``: bytes ``[start/2, stop/2)``, scale columns
    ``[start/sf, stop/sf)``. ``w2_bias`` is kept whole (the caller decides which rank adds it).
    Per-expert scalars are unchanged. Precondition: start and stop are multiples of sf.
    """
    i, sf = c.intermediate_size, c.sf_vec_size
    if start % sf or stop % sf or not 0 <= start < stop <= i:
        raise ValueError(f"slice [{start}, {stop}) of I={i} is not on {sf}-element blocks")
    rows = gemm1_rows(i, start, stop).to(c.w13.device)
    halves = lambda t: t.index_select(1, rows)  # noqa: E731
    return c.replace(w13=halves(c.w13), w13_scale=halves(c.w13_scale),
                     w13_bias=None if c.w13_bias is None else halves(c.w13_bias),
                     w2=c.w2[:, :, gemm2_columns(start, stop, 2)],
                     w2_scale=c.w2_scale[:, :, gemm2_columns(start, stop, sf)])


def concat_experts(parts: list[CanonicalExperts]) -> CanonicalExperts:
    """Stack canonical experts read separately (e.g. a round-robin rank's experts) along dim 0."""
    if len(parts) == 1:
        return parts[0]
    fields = {}
    for k, v in parts[0].__dict__.items():
        fields[k] = None if v is None else torch.cat([getattr(p, k) for p in parts])
    return CanonicalExperts(**fields)


def _pad_halves(t: torch.Tensor, i: int, i_pad: int) -> torch.Tensor:
    """Pad each half of dim 1 (``[up ; gate]``, I rows each) to ``i_pad`` rows with zeros."""
    if i_pad == i:
        return t
    up, gate = t[:, :i], t[:, i:]
    pad = [0, 0] * (t.dim() - 2) + [0, i_pad - i]
    return torch.cat((F.pad(up, pad), F.pad(gate, pad)), dim=1)


def _pad_last(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if t.shape[-1] == n else F.pad(t, (0, n - t.shape[-1]))


def pad_experts(c: CanonicalExperts, hidden_pad: int, inter_pad: int) -> CanonicalExperts:
    """Zero-pad H to ``hidden_pad`` and I to ``inter_pad`` (padding at the end of each dim).

    Padding of w13 is per half, so the result is still ``[up ; gate]`` with ``inter_pad``
    rows each: ``w13 [E, 2*inter_pad, hidden_pad // 2]``, ``w2 [E, hidden_pad, inter_pad // 2]``,
    scales and biases alike. Padded rows, columns and bias entries are zero, so padded outputs
    are zero (SwiGLU of zero is zero). Returns new tensors; the input is not modified.

    Preconditions: ``hidden_pad`` and ``inter_pad`` are multiples of the scale block (32 for
    MXFP4, 16 for NVFP4) and not smaller than H and I.
    """
    e, two_i, _ = c.w13.shape
    i, h, sf = two_i // 2, c.hidden_size, c.sf_vec_size
    if hidden_pad < h or inter_pad < i or hidden_pad % sf or inter_pad % sf:
        raise ValueError(f"cannot pad H={h}, I={i} to {hidden_pad}, {inter_pad} (block {sf})")
    w13 = _pad_last(_pad_halves(c.w13, i, inter_pad), hidden_pad // 2)
    w13_scale = _pad_last(_pad_halves(c.w13_scale, i, inter_pad), hidden_pad // sf)
    w2 = _pad_last(F.pad(c.w2, (0, 0, 0, hidden_pad - h)), inter_pad // 2)
    w2_scale = _pad_last(F.pad(c.w2_scale, (0, 0, 0, hidden_pad - h)), inter_pad // sf)
    w13_bias = None if c.w13_bias is None else _pad_halves(c.w13_bias, i, inter_pad)
    w2_bias = None if c.w2_bias is None else _pad_last(c.w2_bias, hidden_pad)
    return c.replace(w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale, w13_bias=w13_bias, w2_bias=w2_bias)


def unpad_experts(c: CanonicalExperts, hidden: int, inter: int) -> CanonicalExperts:
    """The inverse of :func:`pad_experts`: the top-left ``H = hidden``, ``I = inter`` corner of
    padded experts (each half of ``w13`` cut to its first ``inter`` rows). Views where possible;
    the padding itself is not looked at. Precondition: ``inter`` a multiple of the scale block."""
    if (hidden, inter) == (c.hidden_size, c.intermediate_size):
        return c
    c = slice_intermediate(c, 0, inter) if inter != c.intermediate_size else c
    sf = c.sf_vec_size
    return c.replace(w13=c.w13[:, :, :hidden // 2], w13_scale=c.w13_scale[:, :, :hidden // sf],
                     w2=c.w2[:, :hidden], w2_scale=c.w2_scale[:, :hidden],
                     w2_bias=None if c.w2_bias is None else c.w2_bias[:, :hidden])
