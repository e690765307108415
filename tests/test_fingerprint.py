"""The layout fingerprint: moeshard writes the layout FlashInfer's own index functions define, the
manifest records it per tensor kind, and load_rank / validate take any FlashInfer version that
lays the tensors out the same way and refuse, naming the kinds, one that does not."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import moeshard
from moeshard.convert.pipeline import convert
from moeshard.errors import MoeshardError
from moeshard.layouts.fingerprint import flashinfer_indices, layout_fingerprint, moeshard_indices
from moeshard.validate.run import validate

#: (kind, rows, scale columns): real layers (gpt-oss-120b GEMM1 / GEMM2 padded and trimmed, DeepSeek-R1,
#: Llama-4-Scout) and awkward scale columns (not multiples of 4)
SHAPES = [("gemm1_weights", 6144, None), ("gemm1_weights_scale", 6144, 96), ("gemm2_weights_scale", 3072, 96),
          ("gemm2_weights_scale", 2944, 96), ("gemm2_bias", 2944, None), ("gemm1_weights_scale", 4096, 448),
          ("gemm2_weights_scale", 7168, 16), ("gemm1_weights", 16384, None), ("gemm2_weights_scale", 384, 90),
          ("gemm1_weights_scale", 256, 5)]


@pytest.mark.parametrize("kind,rows,cols", SHAPES)
def test_moeshard_lays_out_what_flashinfer_defines(kind, rows, cols):
    """Row permutations against ``_maybe_get_cached_w3_w1_permute_indices`` /
    ``get_w2_permute_indices_with_cache``; where moeshard's interleave puts every scale byte against
    FlashInfer's reading of the 128x4 layout (``_unswizzle_batched_sf_128x4``)."""
    fi, ms = flashinfer_indices(kind, rows, cols, 128), moeshard_indices(kind, rows, cols, 128)
    assert len(fi) == len(ms) == (1 if cols is None else 2)
    for a, b in zip(fi, ms):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b), kind
    if cols is not None:  # a bijection onto the buffer (padding aside)
        assert fi[1].unique().numel() == rows * cols


def recorded(out):
    return json.loads((out / "moeshard.json").read_text())


def test_the_manifest_records_each_kind(artifacts):
    for family, kinds in (("gpt_oss_tiny", 6), ("deepseek_tiny", 4)):
        m = recorded(artifacts(family, 2))
        p, lay = m["padding"], m["layout"]
        assert m["schema_version"] == 2 and len(lay["fingerprint"]) == kinds
        assert lay["fingerprint"] == layout_fingerprint(lay["fingerprint"], p["hidden_size_padded"], p["gemm2_rows"],
                                                        p["intermediate_size_padded"], lay["sf_vec_size"],
                                                        lay["epilogue_tile_m"])
        assert all(len(v) == 64 and int(v, 16) >= 0 for v in lay["fingerprint"].values())
    # another hidden padding is another GEMM2 layout; GEMM1's is the same
    a, b = (recorded(artifacts("gpt_oss_tiny", 2, 512, hp))["layout"]["fingerprint"] for hp in ("vllm", "trimmed"))
    assert a["gemm1_weights_scale"] == b["gemm1_weights_scale"] and a["gemm2_weights"] != b["gemm2_weights"]


@pytest.fixture
def made_by_another_version(tmp_path, artifacts):
    out = tmp_path / "a"
    shutil.copytree(artifacts("gpt_oss_tiny", 2), out)
    m = recorded(out)
    m["tool"]["flashinfer"] = "0.6.0"
    (out / "moeshard.json").write_text(json.dumps(m))
    return out


def test_another_version_with_the_same_layout_is_taken(made_by_another_version, gpt_oss_tiny):
    assert moeshard.load_rank(made_by_another_version, 1, device="cpu").rank == 1
    assert validate(made_by_another_version, source=gpt_oss_tiny, layers=[0], ranks=[0], tokens=4).passed


def _swap_first_rows(fn, only_scales=False):
    def patched(cache, dst, tile, num_elts_per_sf=None, **kw):
        p = fn(cache, dst, tile, num_elts_per_sf, **kw).clone()
        if num_elts_per_sf is not None or not only_scales:
            p[[0, 1]] = p[[1, 0]]
        return p

    return patched


@pytest.mark.parametrize("target,only_scales,changed", [
    ("get_w2_permute_indices_with_cache", False, "gemm2_bias, gemm2_weights, gemm2_weights_scale"),
    ("_maybe_get_cached_w3_w1_permute_indices", True, "gemm1_weights_scale"),
    ("_unswizzle_batched_sf_128x4", None, "gemm1_weights_scale, gemm2_weights_scale"),
])
def test_a_changed_layout_is_refused(monkeypatch, made_by_another_version, gpt_oss_tiny, target, only_scales, changed):
    from flashinfer.fused_moe import core
    from flashinfer.trace.templates import gemm

    if only_scales is None:  # the 128x4 offsets: the first two swapped
        real = gemm._unswizzle_batched_sf_128x4
        monkeypatch.setattr(gemm, target, lambda sf, *a: real(torch.cat((sf[1:2], sf[:1], sf[2:])), *a))
    else:
        monkeypatch.setattr(core, target, _swap_first_rows(getattr(core, target), only_scales))
    msg = (rf"moeshard\.json: layout\.fingerprint: the installed flashinfer-python 0\.7\.2\.post1 lays out {changed} "
           r"otherwise than flashinfer-python 0\.6\.0, which made this artifact: convert it again with the installed "
           "FlashInfer$")
    with pytest.raises(MoeshardError, match=msg):
        moeshard.load_rank(made_by_another_version, 0, device="cpu")
    with pytest.raises(MoeshardError, match=msg):
        validate(made_by_another_version, source=gpt_oss_tiny)
    assert moeshard.load_rank(made_by_another_version, 0, device="cpu", check_flashinfer=False).rank == 0


def test_convert_refuses_a_flashinfer_laid_out_otherwise(monkeypatch, tmp_path, gpt_oss_tiny):
    from flashinfer.fused_moe import core

    monkeypatch.setattr(core, "_maybe_get_cached_w3_w1_permute_indices",
                        _swap_first_rows(core._maybe_get_cached_w3_w1_permute_indices))
    with pytest.raises(MoeshardError, match=r"^gemm1_weights: the installed flashinfer-python 0\.7\.2\.post1 lays it "
                                            r"out otherwise than this moeshard's trtllm-gen-fp4 version 1 \(\[512\] "
                                            r"per expert\); use a moeshard made for this FlashInfer$"):
        convert(gpt_oss_tiny, tmp_path / "out", ep_size=2)
    assert not (tmp_path / "out").exists()
