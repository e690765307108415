"""DeepSeek-R1-FP4 and Llama-4-Scout-FP4 (ModelOpt NVFP4): rank bytes against FlashInfer's helpers
applied per expert as vLLM's NVFP4 path does, kernel scalars by hand, decode round trips, and the
summed MoE output against transformers' DeepSeek-V3 and Llama-4 MoE modules."""

from __future__ import annotations

import shutil

import pytest
import torch
from _reference import dequant_nvfp4_ref, pad_2d, pad_w13, vllm_nvfp4_trtllm

from moeshard.artifact.manifest import read_manifest
from moeshard.checkpoints.formats import QuantFormat
from moeshard.checkpoints.source import Checkpoint
from moeshard.convert.pipeline import convert
from moeshard.layouts.trtllm import from_trtllm
from moeshard.validate.moe import moe_forward
from moeshard.validate.run import expert_fn

FAMILIES = ["deepseek_tiny", "llama4_tiny"]


def scalar(src: Checkpoint, name: str) -> torch.Tensor:
    return src.read(name).float().reshape(())


def source_experts(src: Checkpoint, family: str, layer: int, e0: int, e1: int) -> dict:
    """One rank's experts straight from the checkpoint, in vLLM's terms: w1 (gate), w3 (up), w2,
    their scales [N, K/16] bytes, weight_scale_2 per expert (vLLM keeps w1's), and the layer's
    input-scale maxima over ALL experts."""
    if family == "deepseek_tiny":
        p = f"model.layers.{layer}.mlp.experts"
        rd = lambda x, proj, leaf: src.read(f"{p}.{x}.{proj}.{leaf}")  # noqa: E731
        xs = range(e0, e1)
        e_all = src.config["n_routed_experts"]
        return {
            "w1": torch.stack([rd(x, "gate_proj", "weight") for x in xs]),
            "w3": torch.stack([rd(x, "up_proj", "weight") for x in xs]),
            "s1": torch.stack([rd(x, "gate_proj", "weight_scale").view(torch.uint8) for x in xs]),
            "s3": torch.stack([rd(x, "up_proj", "weight_scale").view(torch.uint8) for x in xs]),
            "w2": torch.stack([rd(x, "down_proj", "weight") for x in xs]),
            "s2": torch.stack([rd(x, "down_proj", "weight_scale").view(torch.uint8) for x in xs]),
            "w1_scale_2": torch.stack([scalar(src, f"{p}.{x}.gate_proj.weight_scale_2") for x in xs]),
            "w3_scale_2": torch.stack([scalar(src, f"{p}.{x}.up_proj.weight_scale_2") for x in xs]),
            "w2_scale_2": torch.stack([scalar(src, f"{p}.{x}.down_proj.weight_scale_2") for x in xs]),
            "a13": max(scalar(src, f"{p}.{x}.{proj}.input_scale") for x in range(e_all)
                       for proj in ("gate_proj", "up_proj")),
            "a2": max(scalar(src, f"{p}.{x}.down_proj.input_scale") for x in range(e_all)),
        }
    p = f"language_model.model.layers.{layer}.feed_forward.experts"
    gu = src.read(f"{p}.gate_up_proj", e0, e1).transpose(1, 2)  # [E, 2I, H/2], rows [gate ; up]
    gs = src.read(f"{p}.gate_up_proj_weight_scale", e0, e1).view(torch.uint8).transpose(1, 2)
    i = gu.shape[1] // 2
    n = e1 - e0
    return {"w1": gu[:, :i], "w3": gu[:, i:], "s1": gs[:, :i], "s3": gs[:, i:],
            "w2": src.read(f"{p}.down_proj", e0, e1).transpose(1, 2),
            "s2": src.read(f"{p}.down_proj_weight_scale", e0, e1).view(torch.uint8).transpose(1, 2),
            "w1_scale_2": scalar(src, f"{p}.gate_up_proj_weight_scale_2").expand(n),
            "w3_scale_2": scalar(src, f"{p}.gate_up_proj_weight_scale_2").expand(n),
            "w2_scale_2": scalar(src, f"{p}.down_proj_weight_scale_2").expand(n),
            "a13": scalar(src, f"{p}.gate_up_proj_input_scale"), "a2": scalar(src, f"{p}.down_proj_input_scale")}


def rank_tensors(out, rank: dict, prefix: str) -> dict[str, torch.Tensor]:
    with Checkpoint(out / rank["folder"], with_config=False) as f:
        return {n[len(prefix) + 1:]: f.read(n) for n in f.tensors if n.startswith(prefix + ".")}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ep_size,pad", [(1, 256), (2, 256), (4, 128), (8, 256)])
def test_rank_bytes_equal_vllm_flashinfer(request, artifacts, family, ep_size, pad):
    out = artifacts(family, ep_size, pad)
    m = read_manifest(out)
    h_pad, i_pad = m["padding"]["hidden_size_padded"], m["padding"]["intermediate_size_padded"]
    assert (h_pad, i_pad) == (256, 256)  # H = I = 192, padded to 256 by either multiple
    with Checkpoint(request.getfixturevalue(family)) as src:
        for rank in m["ranks"]:
            e0, e1 = rank["experts"][0], rank["experts"][-1] + 1
            for layer in m["moe_layers"]:
                s = source_experts(src, family, layer["layer"], e0, e1)
                # vLLM: reorder_w1w3_to_w3w1, then (moeshard's zero padding), then the per-expert prep.
                want = vllm_nvfp4_trtllm(
                    pad_w13(torch.cat((s["w3"], s["w1"]), 1), i_pad, h_pad // 2),
                    pad_w13(torch.cat((s["s3"], s["s1"]), 1), i_pad, h_pad // 16),
                    pad_2d(s["w2"], h_pad, i_pad // 2), pad_2d(s["s2"], h_pad, i_pad // 16),
                    s["w1_scale_2"], s["w2_scale_2"], s["a13"], s["a2"], w3_scale_2=s["w3_scale_2"])
                got = rank_tensors(out, rank, layer["prefix"])
                assert sorted(got) == sorted(want)
                for leaf, t in want.items():
                    assert got[leaf].dtype == t.dtype and got[leaf].shape == t.shape, leaf
                    assert torch.equal(got[leaf].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), \
                        (rank["rank"], layer["prefix"], leaf)


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_scalars_by_hand_and_identical_on_every_rank(request, artifacts, family):
    out = artifacts(family, 4)
    m = read_manifest(out)
    with Checkpoint(request.getfixturevalue(family)) as src:
        for layer in m["moe_layers"]:
            globals_ = set()
            for rank in m["ranks"]:
                e0, e1 = rank["experts"][0], rank["experts"][-1] + 1
                s = source_experts(src, family, layer["layer"], e0, e1)
                t = rank_tensors(out, rank, layer["prefix"])
                a13, a2 = s["a13"].double(), s["a2"].double()
                gate, up = a13 * s["w1_scale_2"].double(), a13 * s["w3_scale_2"].double()
                torch.testing.assert_close(t["output1_scale_gate_scalar"].double(), gate, rtol=2**-23, atol=0)
                torch.testing.assert_close(t["output1_scale_scalar"].double(), up / a2, rtol=2**-22, atol=0)
                torch.testing.assert_close(t["output2_scale_scalar"].double(), a2 * s["w2_scale_2"].double(),
                                           rtol=2**-23, atol=0)
                assert t["hidden_states_scale_global"].shape == ()
                globals_.add(t["hidden_states_scale_global"].item())
                # a13 and a2 are maxima over the whole layer, not over the rank's experts.
                torch.testing.assert_close(1 / t["hidden_states_scale_global"].double(), a13, rtol=2**-23, atol=0)
            assert len(globals_) == 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ep_size", [1, 4])
def test_decode_gives_source_bytes_and_zero_padding(request, artifacts, family, ep_size):
    out = artifacts(family, ep_size)
    m = read_manifest(out)
    h, i = m["padding"]["hidden_size"], m["padding"]["intermediate_size"]
    with Checkpoint(request.getfixturevalue(family)) as src:
        for rank in m["ranks"]:
            e0, e1 = rank["experts"][0], rank["experts"][-1] + 1
            for layer in m["moe_layers"]:
                s = source_experts(src, family, layer["layer"], e0, e1)
                c = from_trtllm(rank_tensors(out, rank, layer["prefix"]))
                ip = c.intermediate_size
                assert torch.equal(c.w13, pad_w13(torch.cat((s["w3"], s["w1"]), 1), ip, c.hidden_size // 2))
                assert torch.equal(c.w13_scale, pad_w13(torch.cat((s["s3"], s["s1"]), 1), ip, c.hidden_size // 16))
                assert torch.equal(c.w2, pad_2d(s["w2"], c.hidden_size, ip // 2))
                assert torch.equal(c.w2_scale, pad_2d(s["s2"], c.hidden_size, ip // 16))
                # What the kernel applies: gate's scale, and along the up path the product up x down.
                torch.testing.assert_close(c.w1_scale_2, s["w1_scale_2"], rtol=1e-6, atol=0)
                torch.testing.assert_close(c.w3_scale_2 * c.w2_scale_2, s["w3_scale_2"] * s["w2_scale_2"],
                                           rtol=1e-6, atol=0)
                assert (h, i) == (s["w2"].shape[1], s["w1"].shape[1])


def transformers_deepseek_moe(src: Checkpoint, layer: int):
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = {k: v for k, v in src.config.items() if k not in ("auto_map", "architectures", "model_type")}
    moe = DeepseekV3MoE(DeepseekV3Config(**cfg)).float()
    moe.config._experts_implementation = "eager"
    e = src.config["n_routed_experts"]
    p = f"model.layers.{layer}.mlp"
    deq = lambda x, proj: dequant_nvfp4_ref(src.read(f"{p}.experts.{x}.{proj}.weight"),  # noqa: E731
                                            src.read(f"{p}.experts.{x}.{proj}.weight_scale"),
                                            scalar(src, f"{p}.experts.{x}.{proj}.weight_scale_2"))
    with torch.no_grad():
        moe.gate.weight.copy_(src.read(f"{p}.gate.weight").float())
        moe.gate.e_score_correction_bias.copy_(src.read(f"{p}.gate.e_score_correction_bias").float())
        moe.experts.gate_up_proj.copy_(torch.stack([torch.cat((deq(x, "gate_proj"), deq(x, "up_proj"))) for x in range(e)]))
        moe.experts.down_proj.copy_(torch.stack([deq(x, "down_proj") for x in range(e)]))
        for prm in moe.shared_experts.parameters():  # the shared expert lives in common/, not in the ranks
            prm.zero_()
    return moe


def transformers_llama4_moe(src: Checkpoint, layer: int):
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    moe = Llama4TextMoe(Llama4TextConfig(**src.config["text_config"])).float()
    p = f"language_model.model.layers.{layer}.feed_forward"
    gu = src.read(f"{p}.experts.gate_up_proj").transpose(1, 2)
    gs = src.read(f"{p}.experts.gate_up_proj_weight_scale").transpose(1, 2)
    dn = src.read(f"{p}.experts.down_proj").transpose(1, 2)
    ds = src.read(f"{p}.experts.down_proj_weight_scale").transpose(1, 2)
    s13, s2 = scalar(src, f"{p}.experts.gate_up_proj_weight_scale_2"), scalar(src, f"{p}.experts.down_proj_weight_scale_2")
    with torch.no_grad():
        moe.router.weight.copy_(src.read(f"{p}.router.weight").float())
        moe.experts.gate_up_proj.copy_(torch.stack([dequant_nvfp4_ref(gu[x], gs[x], s13).T for x in range(gu.shape[0])]))
        moe.experts.down_proj.copy_(torch.stack([dequant_nvfp4_ref(dn[x], ds[x], s2).T for x in range(dn.shape[0])]))
        for prm in moe.shared_expert.parameters():
            prm.zero_()
    return moe


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_sum_over_ranks_matches_transformers(request, artifacts, family, ep_size):
    pytest.importorskip("transformers")
    out = artifacts(family, ep_size)
    m = read_manifest(out)
    h, h_pad = m["padding"]["hidden_size"], m["padding"]["hidden_size_padded"]
    with Checkpoint(request.getfixturevalue(family)) as src:
        for entry in m["moe_layers"]:
            layer, args = entry["layer"], entry["kernel_args"]
            x = torch.randn(24, h, generator=torch.Generator().manual_seed(layer))
            with torch.no_grad():
                if family == "deepseek_tiny":
                    moe = transformers_deepseek_moe(src, layer)
                    want = moe(x[None])[0]
                    _, weights, ids = moe.gate(x)
                else:
                    moe = transformers_llama4_moe(src, layer)
                    want, _ = moe(x)
                    logits = moe.router(x)[1]
                    vals, ids = torch.topk(logits, 1, dim=-1)
                    weights = torch.sigmoid(vals)
            x_pad = torch.nn.functional.pad(x, (0, h_pad - h))
            total = torch.zeros(24, h_pad)
            for rank in m["ranks"]:
                c = from_trtllm(rank_tensors(out, rank, entry["prefix"]))
                total += moe_forward(x_pad, expert_fn(c, QuantFormat.NVFP4, "cpu"), rank["experts"], ids,
                                     weights, {"type": "swiglu"}, bool(args.get("apply_weight_on_input")))
            assert not total[:, h:].any()
            assert want.abs().max() > 0.05
            torch.testing.assert_close(total[:, :h], want, rtol=1e-5, atol=1e-5)


def test_unequal_gate_up_scale_2_converted_exactly(tmp_path, deepseek_tiny):
    """Gate and up with different weight_scale_2: the artifact's MoE is the source's (gate's scale
    in output1_scale_gate_scalar, up's in output1_scale_scalar), while vLLM's rule (gate's scale
    for both halves) is off by s_up / s_gate on the up half, so on the expert's whole output."""
    from safetensors.torch import load_file, save_file

    from moeshard.layouts.kernel import nvfp4_scalars
    from moeshard.validate import validate

    src = tmp_path / "src"
    shutil.copytree(deepseek_tiny, src)
    p, x = "model.layers.1.mlp.experts", 3
    name = f"{p}.{x}.up_proj.weight_scale_2"
    with Checkpoint(src) as ck:
        f = src / ck.info(name).file
    t = load_file(f)
    t[name] = t[name] * 2  # a checkpoint whose up projection is twice as large, stored with its own scale
    save_file(t, f)
    out = tmp_path / "out"
    convert(src, out, ep_size=2)
    assert validate(out).passed
    m = read_manifest(out)
    rank = next(r for r in m["ranks"] if x in r["experts"])
    layer = next(e for e in m["moe_layers"] if e["layer"] == 1)
    kt = rank_tensors(out, rank, layer["prefix"])
    with Checkpoint(src) as ck:
        s = source_experts(ck, "deepseek_tiny", 1, rank["experts"][0], rank["experts"][-1] + 1)
    k = rank["experts"].index(x)
    assert s["w3_scale_2"][k] == 2 * s["w1_scale_2"][k]
    tokens = torch.randn(16, 192, generator=torch.Generator().manual_seed(0))
    ones, one = torch.ones(16, 1), torch.full((16, 1), x)

    def expert_out(tensors):
        c = from_trtllm(tensors)
        y = moe_forward(torch.nn.functional.pad(tokens, (0, 64)), expert_fn(c, QuantFormat.NVFP4, "cpu"),
                        rank["experts"], one, ones, {"type": "swiglu"})
        return y[:, :192]

    with Checkpoint(src) as ck:
        ref = transformers_deepseek_moe(ck, 1)
        with torch.no_grad():
            g, u = ref.experts.gate_up_proj[x].chunk(2)
            want = (torch.nn.functional.silu(tokens @ g.T) * (tokens @ u.T)) @ ref.experts.down_proj[x].T
    assert want.abs().max() > 0.05
    torch.testing.assert_close(expert_out(kt), want, rtol=1e-5, atol=1e-5)
    vllm = nvfp4_scalars(s["w1_scale_2"], s["w1_scale_2"], s["w2_scale_2"], s["a13"], s["a2"])  # gate's for both
    assert not torch.equal(vllm["output1_scale_scalar"], kt["output1_scale_scalar"])
    torch.testing.assert_close(expert_out({**kt, **vllm}), want * 0.5, rtol=1e-5, atol=1e-5)


def test_routing_args_in_manifest(artifacts):
    ds = read_manifest(artifacts("deepseek_tiny", 2))["moe_layers"][0]["kernel_args"]
    assert (ds["routing_method_type"], ds["top_k"], ds["n_group"], ds["topk_group"], ds["routed_scaling_factor"]) == \
        (2, 4, 4, 2, 2.5)
    l4 = read_manifest(artifacts("llama4_tiny", 2))["moe_layers"][0]["kernel_args"]
    assert (l4["routing_method_type"], l4["top_k"], l4["apply_weight_on_input"]) == (3, 1, True)


@pytest.mark.parametrize("family", FAMILIES)
def test_common_holds_everything_else_unchanged(request, artifacts, family):
    out = artifacts(family, 2)
    m = read_manifest(out)
    with Checkpoint(request.getfixturevalue(family)) as src, Checkpoint(out / "common", with_config=False) as common:
        experts = [e["prefix"] + "." for e in m["moe_layers"]]
        want = sorted(n for n in src.tensors if not n.startswith(tuple(experts)))
        assert sorted(common.tensors) == want
        # shared experts, dense layers and routers among them, byte for byte
        picks = [n for n in want if "shared_expert" in n or ".router." in n or ".mlp.gate." in n
                 or n.startswith("model.layers.0.mlp.")]
        assert len(picks) >= 8
        for n in picks:
            assert torch.equal(src.read(n).reshape(-1).view(torch.uint8), common.read(n).reshape(-1).view(torch.uint8))
    assert (out / "hf_quant_config.json").read_bytes() == (request.getfixturevalue(family) / "hf_quant_config.json").read_bytes()
