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
