"""``load_rank(...).layers[l].kernel_kwargs`` and ``weight_view`` against the installed FlashInfer
0.7.2.post1: every activation form each family's weights take (GPT-OSS: BF16 and MXFP8 hidden
states; NVFP4), both hidden paddings, through the replayed launcher checks and FlashInfer's own
Python side run for real up to the launcher (``flashinfer_launcher``), without a warning."""

from __future__ import annotations

import inspect

import pytest
import torch
from test_trtllm_args import launcher_checks, python_names

import moeshard
from moeshard.errors import MoeshardError
from moeshard.layouts.kernel import ActivationType, RoutingMethod, SfLayout, gemm2_rows
from moeshard.validate.backends import quantize_hidden_states

T = 3


def activations(layer, form: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Hidden states of ``layer`` in ``form`` as engines build them, zero past ``valid_hidden_size``."""
    h, v = layer.hidden_size, layer.valid_hidden_size
    x = torch.zeros(T, h)
    x[:, :v] = torch.randn(T, v, generator=torch.Generator().manual_seed(seed))
    if form == "bf16":
        return x.bfloat16(), None
    if form == "mxfp8":  # mxfp8_quantize(x[:, :v], False, alignment=h) on CUDA: fp8 [T, h], flat UE8M0 [T*h/32];
        # its scales then as vLLM and SGLang pass them: .view(float8_e4m3fn).reshape(T, -1)
        sf = torch.full((T * h // 32,), 127, dtype=torch.uint8)
        return x.to(torch.float8_e4m3fn), sf.view(torch.float8_e4m3fn).reshape(T, -1)
    packed, sf, _ = quantize_hidden_states(x, layer.tensors["hidden_states_scale_global"])
    return packed, sf


def kwargs_of(layer, form: str) -> dict:
    hs, scale = activations(layer, form)
    n = layer.args["num_experts"]
    bias = torch.randn(n) if "correction_bias" in layer.router else None
    return layer.kernel_kwargs(torch.randn(T, n).bfloat16(), hs, scale, bias)


CASES = [("gpt_oss_tiny", 512, "vllm", "bf16"), ("gpt_oss_tiny", 512, "vllm", "mxfp8"),
         ("gpt_oss_tiny", 512, "trimmed", "bf16"), ("gpt_oss_tiny", 512, "trimmed", "mxfp8"),
         ("deepseek_tiny", 256, "vllm", "nvfp4"), ("llama4_tiny", 256, "vllm", "nvfp4"),
         ("deepseek_tiny", 512, "trimmed", "nvfp4")]


@pytest.mark.parametrize("family,pad,hidden_padding,form", CASES)
def test_kernel_kwargs_reach_the_launcher(artifacts, flashinfer_launcher, family, pad, hidden_padding, form):
    from flashinfer.fused_moe import trtllm_fp4_block_scale_moe
    from flashinfer.fused_moe.core import _infer_trtllm_moe_output_hidden_size

    params = inspect.signature(trtllm_fp4_block_scale_moe).parameters
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    out = artifacts(family, 2, pad, hidden_padding)
    for rank in (0, 1):
        rw = moeshard.load_rank(out, rank, device="cpu")
        for layer in rw.layers.values():
            kw = kwargs_of(layer, form)
            assert set(kw) <= set(params) and required <= set(kw), set(kw) ^ set(params)
            assert kw["valid_hidden_size"] == (layer.valid_hidden_size if hidden_padding == "trimmed" else None)
            # GEMM2's rows are what FlashInfer sizes GEMM2 for with these arguments
            assert kw["gemm2_weights"].shape[1] == _infer_trtllm_moe_output_hidden_size(layer.hidden_size,
                                                                                        kw["valid_hidden_size"])
            assert launcher_checks(kw) == [], launcher_checks(kw)
            launched, caught = flashinfer_launcher(trtllm_fp4_block_scale_moe, **kw)
            assert caught == [], [str(w.message) for w in caught]
            assert launched["valid_hidden_size"] == kw["valid_hidden_size"]
            assert launched["hidden_states"] is kw["hidden_states"] and launched["gemm2_bias"] is kw["gemm2_bias"]
            assert launched["output"].shape == (T, layer.output_width) and launched["output"].dtype == torch.bfloat16
            assert launcher_checks(python_names(launched, kw["hidden_states_scale_layout"])) == []
            assert kw["local_expert_offset"] == rw.experts[0] and kw["local_num_experts"] == len(rw.experts)


def test_mismatched_arguments_fail_the_checks(artifacts, flashinfer_launcher):
    """What the checks above catch: valid_hidden_size with the other form's GEMM2, an undeclared
    scale layout (FlashInfer's DeprecationWarning), unpadded hidden states."""
    from flashinfer.fused_moe import trtllm_fp4_block_scale_moe

    vllm = next(iter(moeshard.load_rank(artifacts("gpt_oss_tiny", 2, 512), 0, device="cpu").layers.values()))
    trimmed = next(iter(moeshard.load_rank(artifacts("gpt_oss_tiny", 2, 512, "trimmed"), 0,
                                           device="cpu").layers.values()))
    assert vllm.tensors["gemm2_weights"].shape[1] == 512 and trimmed.tensors["gemm2_weights"].shape[1] == 256
    kw = kwargs_of(vllm, "bf16")
    assert "weight shapes [E,2I,H/2], [E,N,I/2]" in launcher_checks({**kw, "valid_hidden_size": 160})
    kw = kwargs_of(trimmed, "mxfp8")
    assert "weight shapes [E,2I,H/2], [E,N,I/2]" in launcher_checks({**kw, "valid_hidden_size": None})
    assert "hidden_states_scale_layout linear" in launcher_checks({**kw, "hidden_states_scale_layout": None})
    _, caught = flashinfer_launcher(trtllm_fp4_block_scale_moe, **{**kw, "hidden_states_scale_layout": None})
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "hidden_states_scale_layout" in str(caught[0].message)
    with pytest.raises(ValueError, match=r"roundUp\(valid_hidden_size, 128\) must be <= padded hidden_size"):
        trtllm_fp4_block_scale_moe(**{**kw, "hidden_states": kw["hidden_states"][:, :160].contiguous(),
                                      "hidden_states_scale": kw["hidden_states_scale"][:, :5].contiguous()})


def test_kernel_kwargs_refuse_what_the_weights_do_not_take(artifacts):
    gpt = next(iter(moeshard.load_rank(artifacts("gpt_oss_tiny", 2, 512, "trimmed"), 0, device="cpu").layers.values()))
    ds = next(iter(moeshard.load_rank(artifacts("deepseek_tiny", 2), 0, device="cpu").layers.values()))
    logits = torch.zeros(T, gpt.args["num_experts"])
    x = torch.zeros(T, 160, dtype=torch.bfloat16)
    with pytest.raises(MoeshardError, match=r"experts: hidden_states: expected bfloat16 \[T, 512\] or float8_e4m3fn "
                                            r"\[T, 512\] \(MXFP4 weights, zero-padded to hidden_size 512\), found "
                                            r"bfloat16 \[3, 160\]"):
        gpt.kernel_kwargs(logits, x)
    with pytest.raises(MoeshardError, match=r"hidden_states: expected uint8 \[T, 128\] \(NVFP4"):
        ds.kernel_kwargs(torch.zeros(T, 16), torch.zeros(T, 256, dtype=torch.bfloat16))
    hs, scale = activations(gpt, "mxfp8")
    with pytest.raises(MoeshardError, match=r"hidden_states_scale: expected float8_e4m3fn \[T, 16\] \(linear\), "
                                            r"found None"):
        gpt.kernel_kwargs(logits, hs)
    with pytest.raises(MoeshardError, match=r"hidden_states_scale: expected None \(bfloat16 hidden states\)"):
        gpt.kernel_kwargs(logits, hs.bfloat16(), scale)
    with pytest.raises(MoeshardError, match=r"routing_bias: expected None"):
        gpt.kernel_kwargs(logits, hs, scale, torch.zeros(8))
    hs, scale = activations(ds, "nvfp4")
    with pytest.raises(MoeshardError, match=r"routing_bias: DeepSeekV3 routing needs "
                                            r"model\.layers\.\d+\.mlp\.gate\.e_score_correction_bias \(in common/\)"):
        ds.kernel_kwargs(torch.zeros(T, 16), hs, scale)


@pytest.mark.parametrize("family", ["deepseek_tiny", "llama4_tiny"])
def test_weight_view_passes_the_unified_runner(artifacts, flashinfer_launcher, monkeypatch, family):
    """``TrtllmFp4RoutedRunner`` (FlashInfer's unified API) takes ``weight_view`` through its own
    checks (``check_support`` on a Blackwell stand-in, ``pack_inputs``, ``forward``) to the launcher."""
    import flashinfer.utils
    from flashinfer.fused_moe import api
    from flashinfer.fused_moe.core import RoutingInputMode
    from flashinfer.fused_moe.runners import TrtllmFp4RoutedRunner
    from flashinfer.tllm_enums import RoutingMethodType

    monkeypatch.setattr(flashinfer.utils, "get_compute_capability", lambda device: (10, 0))  # check_support asks
    for layer in moeshard.load_rank(artifacts(family, 2), 1, device="cpu").layers.values():
        a = layer.args
        config = api.MoEConfig(
            routing=api.RoutingConfig(a["num_experts"], a["top_k"], RoutingMethodType(a["routing_method_type"]),
                                      a["n_group"], a["topk_group"], a["routed_scaling_factor"]),
            quant=api.QuantConfig(weight=api.QuantFormat.NVFP4, activation=api.QuantFormat.NVFP4),
            experts=api.ExpertConfig(a["intermediate_size"], a["local_expert_offset"], a["local_num_experts"]))
        runner = TrtllmFp4RoutedRunner(config, torch.device("cpu"))
        runner.check_support()
        runner.build()
        weights = api.MoEWeightPack()
        weights.prepare_for(runner.backend_key, layer.weight_view())
        kw = kwargs_of(layer, "nvfp4")
        act = api.MoEActivationPack(kw["hidden_states"], kw["hidden_states_scale"],
                                    routing_input_mode=RoutingInputMode.FromLogits,
                                    routing_logits=kw["routing_logits"], routing_bias=kw["routing_bias"])
        launched, caught = flashinfer_launcher(lambda: runner.forward(runner.pack_inputs(act, weights), tactic=-1))
        assert caught == [], [str(w.message) for w in caught]
        assert launcher_checks(python_names(launched, SfLayout.layout_linear)) == []
        for name in ("gemm1_weights", "gemm1_weights_scale", "gemm2_weights", "gemm2_weights_scale"):
            assert launched[name] is layer.tensors[name], name
        assert torch.equal(launched["output2_scales_scalar"], layer.tensors["output2_scale_scalar"])


def test_weight_view_refuses_what_the_unified_runner_would_get_wrong(artifacts):
    gpt = next(iter(moeshard.load_rank(artifacts("gpt_oss_tiny", 2), 0, device="cpu").layers.values()))
    with pytest.raises(MoeshardError, match=r"gemm1_bias, gemm2_bias: FlashInfer's TrtllmFp4RoutedRunner passes no "
                                            r"biases"):
        gpt.weight_view()
    ds = next(iter(moeshard.load_rank(artifacts("deepseek_tiny", 2, 512, "trimmed"), 0,
                                      device="cpu").layers.values()))
    with pytest.raises(MoeshardError, match=r"gemm2_weights: FlashInfer's TrtllmFp4RoutedRunner expects 512 rows "
                                            r"\(no valid_hidden_size\), found 256"):
        ds.weight_view()


def test_mirrored_enums_and_the_gemm2_row_rule_are_flashinfer_s():
    from flashinfer import tllm_enums
    from flashinfer.fused_moe.core import _infer_trtllm_moe_output_hidden_size

    for ours, theirs in ((SfLayout, tllm_enums.SfLayout), (RoutingMethod, tllm_enums.RoutingMethodType),
                         (ActivationType, tllm_enums.ActivationType)):
        assert all(int(theirs[m.name]) == int(m) for m in ours), ours
    # GPT-OSS 2880 padded to 3072 (vLLM) -> 2944; the tiny fixtures; NVFP4 sizes that need no trimming
    for h, h_pad in ((2880, 3072), (160, 256), (160, 512), (192, 256), (7168, 7168), (5120, 5120), (129, 384)):
        assert gemm2_rows(h, h_pad, "vllm") == _infer_trtllm_moe_output_hidden_size(h_pad, None) == h_pad
        assert gemm2_rows(h, h_pad, "trimmed") == _infer_trtllm_moe_output_hidden_size(h_pad, h)
    assert gemm2_rows(2880, 3072, "trimmed") == 2944
