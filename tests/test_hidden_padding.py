"""``convert --hidden-padding``: vLLM's GEMM2 (padded hidden size rows, the default) or FlashInfer's
trimmed one (roundUp(hidden size, 128) rows, called with ``valid_hidden_size``)."""

from __future__ import annotations

import json

import pytest
import torch

from moeshard.artifact.manifest import Manifest
from moeshard.checkpoints.source import Checkpoint
from moeshard.cli import main
from moeshard.validate.run import validate


@pytest.mark.parametrize("padded,trimmed,cols", [(3072, 2944, 96), (512, 256, 16), (384, 256, 6)])
def test_flashinfer_s_trimmed_gemm2_layout_is_a_prefix(padded, trimmed, cols):
    """From FlashInfer's own index functions alone: GEMM2's row shuffle and 128x4 scale offsets for
    the trimmed rows (2944 = 23 x 128 for GPT-OSS's 2880) are the first rows of the padded ones', so
    a trimmed tensor is the padded one's first rows, byte for byte (weights, biases, scale buffers)."""
    from flashinfer.fused_moe.core import get_w2_permute_indices_with_cache
    from flashinfer.trace.templates.gemm import _unswizzle_batched_sf_128x4

    for sf in (None, 16):
        full, cut = (get_w2_permute_indices_with_cache({}, torch.empty(n, 1, dtype=torch.uint8), 128, sf)
                     for n in (padded, trimmed))
        assert torch.equal(cut, full[:trimmed])
    cp = -(-cols // 4) * 4
    full, cut = (_unswizzle_batched_sf_128x4(torch.arange(n * cp), 1, n, cols)[0] for n in (padded, trimmed))
    assert torch.equal(cut, full[:trimmed]) and int(cut.max()) < trimmed * cp


def test_trimmed_artifact_is_the_vllm_one_with_shorter_gemm2(artifacts):
    """The tiny GPT-OSS (H=160) padded to 512: GEMM2 256 rows instead of 512, everything else equal."""
    vllm, trimmed = artifacts("gpt_oss_tiny", 2, 512), artifacts("gpt_oss_tiny", 2, 512, "trimmed")
    mv, mt = Manifest.read(vllm), Manifest.read(trimmed)
    assert (mv.padding.hidden_padding, mv.padding.gemm2_rows, mt.padding.hidden_padding, mt.padding.gemm2_rows) == \
        ("vllm", 512, "trimmed", 256)
    assert "valid_hidden_size" not in mv.moe_layers[0].kernel_args
    assert mt.moe_layers[0].kernel_args["valid_hidden_size"] == 160
    saved = 0
    for rv, rt in zip(mv.ranks, mt.ranks):
        with Checkpoint(vllm / rv.folder, with_config=False) as a, \
                Checkpoint(trimmed / rt.folder, with_config=False) as b:
            assert sorted(a.tensors) == sorted(b.tensors)
            for name in a.tensors:
                x, y = a.read(name), b.read(name)
                if ".gemm2_" in name:
                    assert y.shape == (x.shape[0], 256, *x.shape[2:]) and x.shape[1] == 512, name
                    x = x[:, :256]
                    saved += a.tensors[name].nbytes - b.tensors[name].nbytes
                assert x.dtype == y.dtype and torch.equal(x.contiguous().view(torch.uint8), y.view(torch.uint8)), name
    assert saved > 0 and sum(f.bytes for r in mv.ranks for f in r.files) - sum(f.bytes for r in mt.ranks
                                                                                for f in r.files) >= saved


def test_trimmed_artifact_validates(artifacts, gpt_oss_tiny):
    report = validate(artifacts("gpt_oss_tiny", 2, 512, "trimmed"), source=gpt_oss_tiny, layers=[1], tokens=8)
    assert report.passed and len(report.rows) == 3, report.to_json()


def test_hidden_padding_flag(monkeypatch, capsys, tmp_path, gpt_oss_tiny):
    monkeypatch.setattr("sys.argv", ["moeshard", "convert", str(gpt_oss_tiny), "-o", str(tmp_path / "o"),
                                     "--hidden-padding", "kernel"])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 1 and err == "moeshard: error: --hidden-padding kernel: expected one of vllm, trimmed\n"
    assert not (tmp_path / "o").exists()
    monkeypatch.setattr("sys.argv", ["moeshard", "convert", str(gpt_oss_tiny), "-o", str(tmp_path / "o"),
                                     "--hidden-padding", "trimmed", "--pad-multiple", "512", "--dry-run", "--json"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["hidden_size_padded"], plan["gemm2_rows"]) == (512, 256)
