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


@pytest.mark.parametrize("nvfp4", [True, False])
def test_nan_scale_check_eight_codes_at_a_time_matches_the_byte_rule(nvfp4):
    """has_nan (words of eight codes) against the byte-wise rule, every code at every position of
    a word, in the tail, and at an offset that forbids the word view."""
    from moeshard.checkpoints.source import has_nan, nan_mask

    for n in (0, 3, 8, 13, 16):
        for pos in range(n):
            for v in range(256):
                b = torch.zeros(n + 1, dtype=torch.uint8)
                b[1 + pos] = v
                for t in (b[1:].clone(), b[1:]):  # aligned copy; storage offset 1
                    assert has_nan(t, nvfp4) == bool(nan_mask(t, nvfp4).any()) == (
                        (v & 0x7F) == 0x7F if nvfp4 else v == 0xFF), (n, pos, v)
    big = torch.zeros(3 << 20, dtype=torch.uint8)  # several 1 MiB steps
    assert not has_nan(big, nvfp4)
    big[-9] = 0xFF
    assert has_nan(big, nvfp4) and not has_nan(big[:-16], nvfp4)


def test_per_expert_read_is_up_then_gate_of_each_expert(deepseek_tiny):
    """The canonical w13 / w13_scale / w2 rows read straight into one tensor equal each expert's
    own tensors read by safetensors: [up ; gate] for GEMM1, down for GEMM2."""
    from safetensors import safe_open

    from moeshard.checkpoints.families import detect, read_experts
    from moeshard.checkpoints.source import Checkpoint

    with Checkpoint(deepseek_tiny) as ckpt:
        adapter = detect(ckpt)
        spec = adapter.spec(ckpt)
        layer = spec.moe_layers[0]
        c = read_experts(adapter, ckpt, spec, layer, 3, 7)
        p = spec.prefix(layer)

        def st(name):
            with safe_open(deepseek_tiny / ckpt.info(name).file, "pt") as f:
                return f.get_tensor(name).view(torch.uint8)

        for k, e in enumerate(range(3, 7)):
            assert torch.equal(c.w13[k], torch.cat([st(f"{p}.{e}.up_proj.weight"), st(f"{p}.{e}.gate_proj.weight")]))
            assert torch.equal(c.w13_scale[k].view(torch.uint8), torch.cat(
                [st(f"{p}.{e}.up_proj.weight_scale"), st(f"{p}.{e}.gate_proj.weight_scale")]))
            assert torch.equal(c.w2[k], st(f"{p}.{e}.down_proj.weight"))
