"""The trtllm-gen backend's arguments, checked on the CPU against what the installed FlashInfer's
``trtllm_fp4_block_scale_moe`` and its C++ launcher check (0.7.2.post1:
``fused_moe/core.py``, ``data/csrc/trtllm_fused_moe_kernel_launcher.cu``,
``data/csrc/fused_moe/trtllm_backend/trtllm_fused_moe_routing_*.cu``), so that the Blackwell path
fails on no argument when the hardware is there. The kernel itself cannot run here."""

from __future__ import annotations

import inspect

import pytest
import torch

from moeshard.artifact.manifest import read_manifest
from moeshard.checkpoints.source import Checkpoint
from moeshard.validate.backends import trtllm_args

FAMILIES = ["gpt_oss_tiny", "deepseek_tiny", "llama4_tiny"]


def launcher_checks(a: dict) -> list[str]:
    """Every check the 0.7.2.post1 Python wrapper and FP4 launcher make, as messages for those that
    fail (``a``: the wrapper's keyword arguments, or the launcher's own by :func:`python_names`;
    ``L:`` = ``trtllm_fused_moe_kernel_launcher.cu``, ``core.py`` = ``fused_moe/core.py``)."""
    bad = []

    def need(cond, msg):
        if not cond:
            bad.append(msg)

    hs, hss = a["hidden_states"], a["hidden_states_scale"]
    t = hs.shape[0]
    h = hs.shape[-1] * (2 if hs.dtype == torch.uint8 else 1)  # L:6023-6025, core.py:3499-3501: H doubled for uint8
    ne, loc, off, k = a["num_experts"], a["local_num_experts"], a["local_expert_offset"], a["top_k"]
    i = a["intermediate_size"]
    need(hs.dtype in (torch.uint8, torch.bfloat16, torch.float8_e4m3fn), "hidden_states dtype")  # L:6074
    # routing_logits: 2-D [T, num_experts], f32 or bf16 (L:1238-1251)
    rl = a["routing_logits"]
    need(rl.dim() == 2 and rl.shape == (t, ne) and rl.dtype in (torch.float32, torch.bfloat16), "routing_logits")
    rb = a["routing_bias"]  # L:6057-6065
    need(rb is None or (rb.dim() == 1 and rb.shape[0] == ne and rb.dtype in (torch.float32, torch.bfloat16)),
         "routing_bias")
    # check_routing_common (L:1393-1405)
    need(1 <= k <= ne and 1 <= loc <= ne and off >= 0 and off + loc <= ne, "expert window / top_k")
    # valid_hidden_size: positive, <= H (L:65-73); GEMM2's N = roundUp(v, 128) <= H (L:118-126, core.py:365-385);
    # do_finalize=False only where roundUp(v, 128) == H (core.py:408-437)
    v, n2 = a.get("valid_hidden_size"), h
    if v is not None:
        n2 = -(-v // 128) * 128
        need(0 < v <= h and n2 <= h, "valid_hidden_size: 0 < v, roundUp(v, 128) <= padded hidden size")
        need(a.get("do_finalize", True) or n2 == h, "valid_hidden_size with do_finalize=False")
    # output: bf16 [T, <= H], exactly valid_hidden_size wide when given (core.py:3552-3569, L:129-135)
    out = a.get("output")
    need(out is None or (out.dtype == torch.bfloat16 and out.shape[0] == t and out.shape[1] <= h
                         and (v is None or out.shape[1] == v)), "output [T, valid_hidden_size or <= H] bf16")
    # activation dtype from the scale vector size (L:6030-6036, L:6076-6099)
    vec = t * h // hss.numel() if hss is not None and hss.numel() else 0
    if hs.dtype == torch.uint8:
        need(hss is not None and hss.dtype == torch.float8_e4m3fn, "hidden_states_scale must be float8_e4m3fn")
        need(vec == 16, f"activation scale vector {vec}, expected 16 (E2m1)")  # 32: MxE2m1, refused by L:5081
    elif hs.dtype == torch.float8_e4m3fn:
        need(hss is not None and vec == 32, f"FP8 activations: scale vector {vec}, expected 32 (MxE4m3)")  # L:6091-6099
    else:
        need(hss is None, "bf16 activations take no scale")
    if hss is not None:
        need(hss.dim() == 1 or hss.shape[0] == t, "hidden_states_scale rows == T")  # tuning.py:290
        need(a.get("hidden_states_scale_layout") is not None and int(a["hidden_states_scale_layout"]) == 2,
             "hidden_states_scale_layout linear")  # validation.py:98-149
    w1, w2, s1, s2 = a["gemm1_weights"], a["gemm2_weights"], a["gemm1_weights_scale"], a["gemm2_weights_scale"]
    need(w1.dtype == torch.uint8 and w2.dtype == torch.uint8, "weights uint8")  # L:6072
    need(s1.dtype == torch.float8_e4m3fn and s2.dtype == torch.float8_e4m3fn, "weight scales e4m3")  # L:5116-5121
    # weight format from the GEMM1 scale size (L:6038-6054)
    raw = loc * i * 2 * h / s1.numel()
    wvec = 32 if raw > 16 else 16
    need(s1.numel() >= loc * i * 2 * h // wvec, "gemm1_weights_scale numel")
    # Stricter than the FP4 launcher, which checks no weight shape (L:5122): GEMM1 [E, 2I, H/2]; GEMM2 has N rows,
    # "what the FC2 weights / biases / weight scales are sized against" (core.py:365-377, L:1301-1308)
    need(w1.shape == (loc, 2 * i, h // 2) and w2.shape == (loc, n2, i // 2), "weight shapes [E,2I,H/2], [E,N,I/2]")
    need(s1.shape == (loc, 2 * i, h // wvec) and s2.shape == (loc, n2, i // wvec), "weight scale shapes")
    if hs.dtype == torch.uint8:  # E2m1 activations need E2m1 weights and the three scalars (L:5089-5099)
        need(wvec == 16, "E2m1 activations need NVFP4 weights")
        for n in ("output1_scale_scalar", "output1_scale_gate_scalar", "output2_scale_scalar"):
            x = a[n]
            need(x is not None and x.dtype == torch.float32 and x.shape == (loc,) and x.is_contiguous(), n)
    else:  # bf16 and MxE4m3 activations need MxE2m1 weights (L:5101-5104)
        need(wvec == 32, "bf16 / MXFP8 activations need MXFP4 weights")
    # read as float* per local expert, unchecked by the launcher: f32, contiguous, local length
    for n, shape in (("gemm1_bias", (loc, 2 * i)), ("gemm2_bias", (loc, n2)), ("gemm1_alpha", (loc,)),
                     ("gemm1_beta", (loc,)), ("gemm1_clamp_limit", (loc,))):
        x = a[n]
        need(x is None or (x.dtype == torch.float32 and x.shape == shape and x.is_contiguous()), n)
    # routing limits (routing_runner.cu, routing_deepseek.cu, routing_llama4.cu, routing_custom.cuh)
    method = a["routing_method_type"]
    if method == 1:
        need(k <= 32 and ne <= 2048, "Renormalize limits")
    elif method == 2:
        ng, kg = a["n_group"] or 0, a["topk_group"] or 0
        if ng > 1:
            need(k <= 22 and kg <= 4 and ne <= 512 and ng <= 8 and ne % ng == 0 and ne // ng <= 32 and ng >= kg
                 and ne % 4 == 0 and ne >= k, "DeepSeekV3 grouped limits")
        else:
            need(k <= 32 and ne <= 2048, "DeepSeekV3 limits")
    elif method == 3:
        need(k == 1 and ne <= 128, "Llama4 limits")
    else:
        bad.append(f"unexpected routing_method_type {method}")
    return bad


def python_names(launched: dict, hidden_states_scale_layout) -> dict:
    """The launcher's arguments (``flashinfer_launcher``) under the wrapper's names, for
    :func:`launcher_checks`; the layout is declared to the Python side only."""
    renamed = {"output1_scales_scalar": "output1_scale_scalar", "output2_scales_scalar": "output2_scale_scalar",
               "output1_scales_gate_scalar": "output1_scale_gate_scalar", "act_type": "activation_type"}
    return {**{renamed.get(k, k): x for k, x in launched.items()},
            "hidden_states_scale_layout": hidden_states_scale_layout}


@pytest.mark.parametrize("family,pad,hidden_padding", [(f, 256, "vllm") for f in FAMILIES]
                         + [("gpt_oss_tiny", 512, "trimmed")])
def test_arguments_pass_the_launcher_checks(artifacts, flashinfer_launcher, family, pad, hidden_padding):
    """validate's trtllm-gen arguments: the signature, the replayed launcher checks, and FlashInfer's
    own Python side run for real up to the launcher, without a warning."""
    from flashinfer.fused_moe import trtllm_fp4_block_scale_moe

    params = inspect.signature(trtllm_fp4_block_scale_moe).parameters
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    out = artifacts(family, 2, pad, hidden_padding)
    m = read_manifest(out)
    h_pad = m["padding"]["hidden_size_padded"]
    for entry in m["moe_layers"]:
        for rank in m["ranks"]:
            with Checkpoint(out / rank["folder"], with_config=False) as f:
                p = entry["prefix"]
                kt = {n[len(p) + 1:]: f.read(n) for n in f.tensors if n.startswith(p + ".")}
            x = torch.randn(5, h_pad)
            logits = torch.randn(5, m["num_experts"])
            bias = torch.randn(m["num_experts"]) if family == "deepseek_tiny" else None
            args, x_used = trtllm_args(kt, entry["kernel_args"], rank, x, logits, bias)
            assert set(args) <= set(params), set(args) - set(params)
            assert required <= set(args), required - set(args)
            assert launcher_checks(args) == [], (family, rank["rank"], launcher_checks(args))
            launched, caught = flashinfer_launcher(trtllm_fp4_block_scale_moe, **args)
            assert caught == [], [str(w.message) for w in caught]
            assert launched["valid_hidden_size"] == (m["padding"]["hidden_size"] if hidden_padding == "trimmed"
                                                     else None)
            assert launcher_checks(python_names(launched, args["hidden_states_scale_layout"])) == []
            assert x_used.shape == (5, h_pad) and x_used.dtype == torch.float32
            if family != "gpt_oss_tiny":  # NVFP4 activations: the reference sees the quantized values
                assert (x_used - x).abs().max() > 0 and (x_used - x).norm() / x.norm() < 0.2


def test_real_model_routing_fits_the_kernel_limits():
    """DeepSeek-R1 (256 experts, 8 groups, top-4 groups, top-8), gpt-oss-120b (128, top-4) and
    Llama-4-Scout (16, top-1) routing arguments against the launcher's routing limits."""
    cases = [(2, 256, 8, 8, 4), (1, 128, 4, None, None), (3, 16, 1, None, None)]
    for method, ne, k, ng, kg in cases:
        a = {"routing_method_type": method, "num_experts": ne, "top_k": k, "n_group": ng, "topk_group": kg}
        assert _routing_only(a) == [], method
    assert _routing_only({"routing_method_type": 3, "num_experts": 16, "top_k": 2, "n_group": None,
                          "topk_group": None}) == ["Llama4 limits"]


def _routing_only(a: dict) -> list[str]:
    full = dict(hidden_states=torch.zeros(1, 64, dtype=torch.bfloat16), hidden_states_scale=None,
                routing_logits=torch.zeros(1, a["num_experts"]), routing_bias=None,
                local_num_experts=1, local_expert_offset=0, intermediate_size=64,
                gemm1_weights=torch.zeros(1, 128, 32, dtype=torch.uint8),
                gemm2_weights=torch.zeros(1, 64, 32, dtype=torch.uint8),
                gemm1_weights_scale=torch.zeros(1, 128, 2, dtype=torch.float8_e4m3fn),
                gemm2_weights_scale=torch.zeros(1, 64, 2, dtype=torch.float8_e4m3fn),
                **{n: None for n in ("gemm1_bias", "gemm2_bias", "gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit",
                                     "output1_scale_scalar", "output1_scale_gate_scalar", "output2_scale_scalar")},
                **a)
    return launcher_checks(full)
