"""The MoE output computed from the converted shards (decoded, dequantized, summed over ranks)
against transformers' own GPT-OSS MoE (GptOssMLP) fed by its own MXFP4 dequantizer."""

from __future__ import annotations

import pytest
import torch

from moeshard.artifact.manifest import read_manifest
from moeshard.checkpoints.formats.fp4 import dequantize_mxfp4
from moeshard.checkpoints.source import Checkpoint
from moeshard.layouts.trtllm import from_trtllm
from moeshard.validate.moe import moe_forward

transformers = pytest.importorskip("transformers")
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP  # noqa: E402


def transformers_mlp(src: Checkpoint, layer: int) -> GptOssMLP:
    cfg = {k: v for k, v in src.config.items() if k not in ("quantization_config", "architectures", "model_type")}
    config = GptOssConfig(**cfg)
    config._experts_implementation = "eager"
    mlp = GptOssMLP(config).float()
    p = f"model.layers.{layer}.mlp"
    with torch.no_grad():
        mlp.router.weight.copy_(src.read(f"{p}.router.weight").float())
        mlp.router.bias.copy_(src.read(f"{p}.router.bias").float())
        ex = mlp.experts
        ex.gate_up_proj.copy_(convert_moe_packed_tensors(src.read(f"{p}.experts.gate_up_proj_blocks"),
                                                         src.read(f"{p}.experts.gate_up_proj_scales"), dtype=torch.float32))
        ex.gate_up_proj_bias.copy_(src.read(f"{p}.experts.gate_up_proj_bias").float())
        ex.down_proj.copy_(convert_moe_packed_tensors(src.read(f"{p}.experts.down_proj_blocks"),
                                                      src.read(f"{p}.experts.down_proj_scales"), dtype=torch.float32))
        ex.down_proj_bias.copy_(src.read(f"{p}.experts.down_proj_bias").float())
    return mlp


@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_sum_over_ranks_matches_transformers(gpt_oss_tiny, gpt_oss_artifacts, ep_size):
    out = gpt_oss_artifacts(ep_size)
    m = read_manifest(out)
    h = m["padding"]["hidden_size"]
    h_pad = m["padding"]["hidden_size_padded"]
    with Checkpoint(gpt_oss_tiny) as src:
        for entry in m["moe_layers"]:
            layer = entry["layer"]
            mlp = transformers_mlp(src, layer)
            x = torch.randn(1, 24, h, generator=torch.Generator().manual_seed(layer))
            with torch.no_grad():
                want, _ = mlp(x)
                _, scores, ids = mlp.router(x[0])
            x_pad = torch.nn.functional.pad(x[0], (0, h_pad - h))
            total = torch.zeros(24, h_pad)
            for rank in m["ranks"]:
                with Checkpoint(out / rank["folder"], with_config=False) as f:
                    p = entry["prefix"]
                    kt = {n[len(p) + 1:]: f.read(n) for n in f.tensors if n.startswith(p + ".")}
                c = from_trtllm(kt)

                def expert(e, c=c):
                    return (dequantize_mxfp4(c.w13[e], c.w13_scale[e]), dequantize_mxfp4(c.w2[e], c.w2_scale[e]),
                            c.w13_bias[e], c.w2_bias[e])

                act = {"type": "swiglu_oai", "alpha": kt["gemm1_alpha"], "beta": kt["gemm1_beta"],
                       "limit": kt["gemm1_clamp_limit"]}
                total += moe_forward(x_pad, expert, rank["experts"], ids, scores, act)
            assert not total[:, h:].any()
            torch.testing.assert_close(total[:, :h], want[0], rtol=1e-5, atol=1e-5)
            assert want.abs().max() > 0.1  # the comparison is not between two near-zero tensors


def test_tiny_preset_loads_in_transformers(tmp_path):
    """The tiny GPT-OSS fixture is a checkpoint transformers itself loads: GptOssForCausalLM with
    its MXFP4 dequantizer on the CPU, no missing or unexpected keys, a forward pass."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    from moeshard.fixtures import fixture

    src = fixture("gpt-oss", "tiny", tmp_path / "src")
    model, info = GptOssForCausalLM.from_pretrained(src, quantization_config=Mxfp4Config(dequantize=True),
                                                     dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 200]])).logits
    assert logits.shape == (1, 4, 256) and torch.isfinite(logits).all()
    with Checkpoint(src) as ck:  # its experts are the checkpoint's, decoded
        blocks, scales = ck.read("model.layers.1.mlp.experts.down_proj_blocks"), \
            ck.read("model.layers.1.mlp.experts.down_proj_scales")
    want = dequantize_mxfp4(blocks.flatten(-2), scales).transpose(1, 2)  # transformers' [E, I, H]
    torch.testing.assert_close(model.model.layers[1].mlp.experts.down_proj.float(), want, rtol=0, atol=0)
