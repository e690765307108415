"""The CPU 128x4 scale interleave against the layout formula, on awkward shapes."""

import pytest
import torch
from _reference import interleave_formula

from moeshard.layouts.scales import deinterleave_scales_128x4, interleave_scales_128x4

#: Rows and columns off multiples of 128 and 4, and on them.
SHAPES = [(1, 1), (31, 3), (120, 5), (128, 4), (200, 7), (256, 90), (384, 13)]


@pytest.mark.parametrize("m,k", SHAPES)
def test_interleave_matches_formula(m, k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    sf = torch.randint(0, 255, (3, m, k), dtype=torch.uint8, generator=g)
    got = interleave_scales_128x4(sf)
    for e in range(3):
        assert torch.equal(got[e].flatten(), interleave_formula(sf[e]))


@pytest.mark.parametrize("m,k", SHAPES)
def test_deinterleave_inverts(m, k):
    sf = torch.randint(0, 255, (2, m, k), dtype=torch.uint8)
    assert torch.equal(deinterleave_scales_128x4(interleave_scales_128x4(sf), m, k), sf)


def test_hand_checked_offsets():
    # One non-zero byte at a time in a [256, 8] matrix (Kp/4 = 2 column groups).
    cases = {(0, 0): 0, (0, 1): 1, (0, 3): 3, (0, 4): 512, (1, 0): 16, (31, 0): 496,
             (32, 0): 4, (96, 2): 14, (128, 0): 1024, (129, 5): 1024 + 512 + 16 + 1}
    for (m, k), off in cases.items():
        sf = torch.zeros(1, 256, 8, dtype=torch.uint8)
        sf[0, m, k] = 7
        flat = interleave_scales_128x4(sf).flatten()
        assert flat[off] == 7 and int(flat.count_nonzero()) == 1, (m, k, off)


def test_keeps_fp8_label_and_padding_is_zero():
    sf = torch.full((1, 100, 3), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = interleave_scales_128x4(sf)
    assert out.dtype == torch.float8_e4m3fn and out.shape == (1, 128, 4)
    assert int(out.view(torch.uint8).count_nonzero()) == 300


@pytest.mark.parametrize("h,i,hp,ip", [(160, 224, 256, 256), (192, 96, 256, 128), (256, 128, 256, 128),
                                       (2880 // 9, 2880 // 9, 384, 384)])
def test_fused_padding_equals_pad_then_layout(h, i, hp, ip):
    from moeshard.layouts.canonical import CanonicalExperts, pad_experts
    from moeshard.layouts.trtllm import to_trtllm, to_trtllm_padded

    g = torch.Generator().manual_seed(h + i)
    sf = 32 if h % 32 == 0 and i % 32 == 0 else 16
    r = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g)  # noqa: E731
    c = CanonicalExperts(r(3, 2 * i, h // 2), r(3, 2 * i, h // sf), r(3, h, i // 2), r(3, h, i // sf),
                         torch.randn(3, 2 * i, generator=g), torch.randn(3, h, generator=g))
    want = to_trtllm(pad_experts(c, hp, ip))
    got = to_trtllm_padded(c, hp, ip)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


@pytest.mark.parametrize("rows", [[3, 1, 4, 0, -1, -1], [3, -1, 1, 4, -1, 0], [-1, 2]])
def test_gather_rows_against_plain_indexing(rows):
    """Zero rows last (one gather per expert into place) or anywhere; a column-sliced source;
    a destination full of stale bytes (a reused staging buffer) is overwritten everywhere."""
    from moeshard.layouts.trtllm import gather_rows

    rows = torch.tensor(rows)
    valid = rows >= 0
    full = torch.randint(0, 256, (3, 5, 24), dtype=torch.uint8)
    for src in (full, full[:, :, 8:], full[:, :, :16].view(torch.int16)):
        c = src.shape[2]
        want = torch.zeros(3, len(rows), c + 4, dtype=src.dtype)
        want[:, valid, :c] = src[:, rows[valid]]
        assert torch.equal(gather_rows(src, rows, c + 4), want)
        out = torch.full_like(want, 7)
        assert gather_rows(src, rows, c + 4, out=out) is out and torch.equal(out, want)
    bias = torch.randn(3, 5)
    want = torch.zeros(3, len(rows))
    want[:, valid] = bias[:, rows[valid]]
    assert torch.equal(gather_rows(bias, rows, 1), want)


@pytest.mark.parametrize("offset", [0, 1, 4])
def test_interleave_into_a_buffer_at_any_offset(offset):
    """Into a staging buffer: 4-byte aligned (copied as int32 words) or not (byte copy)."""
    sf = torch.randint(0, 256, (3, 256, 12), dtype=torch.uint8)
    buf = torch.zeros(sf.numel() + offset, dtype=torch.uint8)
    out = buf[offset:].view(3, 256, 12)
    assert interleave_scales_128x4(sf, out) is out
    assert all(torch.equal(out[e].flatten(), interleave_formula(sf[e])) for e in range(3))
