"""FP4 codecs against hand-checked values and against transformers' MXFP4 dequantizer."""

import pytest
import torch

from moeshard.checkpoints.formats.fp4 import (
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_e2m1,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_fp4,
)


def test_e2m1_rounds_to_nearest_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -5.0, 0.26, 0.74, -100.0, 0.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -4.0, 0.5, 0.5, -6.0, 0.0])
    assert torch.equal(unpack_fp4(quantize_e2m1(x)), want)


def test_nibble_order_low_is_even():
    packed = quantize_e2m1(torch.tensor([1.0, -6.0]))  # codes 2 and 15
    assert packed.tolist() == [0xF2]


def test_every_byte_and_every_scale_decodes_by_hand():
    """Each of the 256 packed bytes (two nibbles, low first) under each UE8M0 scale 0..254 and each
    E4M3 scale, by the formula; and an odd number of bytes per row."""
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    packed = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat(255, 1, 1)  # [255, 16, 16]
    scales = torch.arange(255, dtype=torch.uint8).view(255, 1, 1).expand(255, 16, 1)
    want = torch.tensor([[values[b & 15] * 2.0 ** (s - 127), values[b >> 4] * 2.0 ** (s - 127)]
                         for s in range(255) for b in range(256)], dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(packed, scales).flatten(), want.flatten())
    e4m3 = [s for s in range(256) if s & 0x7F != 0x7F]  # every E4M3 scale but NaN, one block each
    nv = dequantize_nvfp4(torch.arange(256, dtype=torch.uint8).view(32, 8).repeat(len(e4m3), 1, 1),
                          torch.tensor(e4m3, dtype=torch.uint8).view(-1, 1, 1).expand(-1, 32, 1), 0.75)
    scale = torch.tensor(e4m3, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    want = torch.tensor([[values[b & 15] * s, values[b >> 4] * s] for s in scale for b in range(256)])
    assert torch.equal(nv.flatten(), (want * 0.75).flatten())
    odd = torch.tensor([[0x21, 0xF7, 0x9A]], dtype=torch.uint8)
    assert unpack_fp4(odd).tolist() == [[0.5, 1.0, 6.0, -6.0, -1.0, -0.5]]


def test_mxfp4_matches_transformers_dequantizer():
    pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 64, 96) * 0.05
    packed, scales = quantize_mxfp4(w)
    ours = dequantize_mxfp4(packed, scales)  # [3, 64, 96]
    theirs = convert_moe_packed_tensors(packed.view(3, 64, 3, 16), scales, dtype=torch.float32)  # [3, 96, 64]
    assert torch.equal(ours, theirs.transpose(1, 2))
    # OCP MX scale choice: block amax / 2**(s-127) lies in [4, 8), within E2M1's range after rounding.
    err = (ours - w).abs().amax()
    assert err <= w.abs().amax() / 4
    assert 0 < int(scales.min()) and int(scales.max()) < 255


def test_nvfp4_modelopt_recipe():
    w = torch.randn(32, 64)
    packed, bscale, s2 = quantize_nvfp4(w)
    assert bscale.dtype == torch.float8_e4m3fn and bscale.shape == (32, 4)
    assert torch.isclose(s2, w.abs().amax() / (6 * 448))
    deq = dequantize_nvfp4(packed, bscale, s2)
    assert (deq - w).abs().amax() < w.abs().amax() / 6
