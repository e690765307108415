"""The checkpoints people publish, exactly as exported: DeepSeek-V3-architecture (R1's index quirk
and MTP layer, V3-0324's leftover FP8 config, Kimi-K2, Kimi-K2.5 nested, llm-compressor, ModelOpt
MIXED_PRECISION), Qwen3-MoE (ModelOpt, llm-compressor, no renormalisation) and Llama-4 (both key
prefixes, per-expert scales, Maverick's interleaved layers, llm-compressor's unfused experts).

For each, under EP, TP and EP x TP: every rank tensor byte for byte against vLLM's preparation
rebuilt per expert from FlashInfer's helpers (compressed-tensors: vLLM's reciprocal arithmetic
first; gate and up with their own scales: up's in output1_scale_scalar), read from the files
with the exporter's own names (not moeshard's adapters); and the sum over ranks of the decoded
MoE against transformers' own module (DeepseekV3MoE, Qwen3MoeSparseMoeBlock, Llama4TextMoe).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from _reference import dequant_nvfp4_ref, pad_2d, pad_w13, vllm_nvfp4_trtllm
from test_nvfp4 import rank_tensors

from moeshard.artifact.manifest import read_manifest
from moeshard.checkpoints.formats import QuantFormat
from moeshard.checkpoints.source import Checkpoint
from moeshard.convert.pipeline import convert
from moeshard.errors import MoeshardError
from moeshard.fixtures import fixture
from moeshard.layouts.trtllm import from_trtllm
from moeshard.validate.moe import moe_forward, route
from moeshard.validate.run import expert_fn

#: case -> (fixture family, preset, exporter, root, storage)
CASES = {
    "deepseek-r1": ("deepseek", "tiny", "modelopt", "model", "per-expert"),
    "deepseek-v3-0324": ("deepseek", "tiny-v3-0324", "modelopt", "model", "per-expert"),
    "kimi-k2": ("deepseek", "tiny-kimi-k2", "modelopt", "model", "per-expert"),
    "kimi-k25": ("deepseek", "tiny-kimi-k25", "modelopt", "language_model.model", "per-expert"),
    "deepseek-ct": ("deepseek", "tiny-ct", "compressed-tensors", "model", "per-expert"),
    "deepseek-mixed": ("deepseek", "tiny-mixed", "modelopt", "model", "per-expert"),
    "qwen3": ("qwen3-moe", "tiny", "modelopt", "model", "per-expert"),
    "qwen3-ct": ("qwen3-moe", "tiny-ct", "compressed-tensors", "model", "per-expert"),
    "qwen3-no-renorm": ("qwen3-moe", "tiny-no-renorm", "modelopt", "model", "per-expert"),
    "llama4-flat": ("llama4", "tiny-flat", "modelopt", "model", "fused"),
    "llama4-maverick": ("llama4", "tiny-maverick", "modelopt", "language_model.model", "fused"),
    "llama4-ct": ("llama4", "tiny-ct", "compressed-tensors", "language_model.model", "per-expert"),
}
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
#: exporter -> (weight, block scale, per-tensor scale, input scale, stored inverted)
LEAVES = {"modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale", False),
          "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", True)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    made = {}

    def get(case: str):
        if case not in made:
            family, preset = CASES[case][:2]
            made[case] = fixture(family, preset, tmp_path_factory.mktemp(case) / "src")
        return made[case]

    return get


@pytest.fixture(scope="module")
def converted(tmp_path_factory, sources):
    made = {}

    def get(case: str, ep: int, tp: int):
        if (case, ep, tp) not in made:
            out = tmp_path_factory.mktemp(f"{case}-ep{ep}-tp{tp}") / "out"
            convert(sources(case), out, ep_size=ep, tp_size=tp)
            made[(case, ep, tp)] = out
        return made[(case, ep, tp)]

    return get


def text(cfg: dict) -> dict:
    return cfg["text_config"] if "text_config" in cfg else cfg


def moe_prefix(case: str, layer: int) -> str:
    family, _, _, root, _ = CASES[case]
    return f"{root}.layers.{layer}.{'feed_forward' if family == 'llama4' else 'mlp'}"


def oracle_experts(src: Checkpoint, case: str, layer: int, experts: list[int], e_all: int) -> dict:
    """A layer's experts read straight from the files by the exporter's names, in vLLM's terms: w1
    (gate), w3 (up), w2 and their block-scale bytes; per-tensor scales as vLLM computes them
    (compressed-tensors: ``1 / weight_global_scale``); a13 / a2 the maxima over ALL experts (and
    over gate and up) of the activation scales (compressed-tensors: of ``1 / input_global_scale``)."""
    _, _, exporter, _, storage = CASES[case]
    p = moe_prefix(case, layer) + ".experts"
    wl, sl, gl, il, inv = LEAVES[exporter]
    f32 = lambda name: src.read(name).float().reshape(-1)  # noqa: E731
    scale = lambda t: 1.0 / t if inv else t  # noqa: E731
    if storage == "fused":  # ModelOpt Llama-4: [E, K/2, N] bmm layout, N = [gate ; up]
        gu, gs = src.read(f"{p}.gate_up_proj").transpose(1, 2), src.read(f"{p}.gate_up_proj_weight_scale").transpose(1, 2)
        i = gu.shape[1] // 2
        per = lambda leaf: f32(f"{p}.{leaf}").expand(e_all) if f32(f"{p}.{leaf}").numel() == 1 else f32(f"{p}.{leaf}")  # noqa: E731
        return {"w1": gu[experts, :i], "w3": gu[experts, i:], "s1": gs[experts, :i].view(torch.uint8),
                "s3": gs[experts, i:].view(torch.uint8), "w2": src.read(f"{p}.down_proj").transpose(1, 2)[experts],
                "s2": src.read(f"{p}.down_proj_weight_scale").transpose(1, 2)[experts].view(torch.uint8),
                "s1_2": per("gate_up_proj_weight_scale_2")[experts], "s3_2": per("gate_up_proj_weight_scale_2")[experts],
                "s2_2": per("down_proj_weight_scale_2")[experts], "a13": per("gate_up_proj_input_scale").max(),
                "a2": per("down_proj_input_scale").max()}
    rd = lambda proj, leaf: torch.stack([src.read(f"{p}.{x}.{proj}.{leaf}") for x in experts])  # noqa: E731
    sc = lambda xs, proj, leaf: torch.stack([scale(f32(f"{p}.{x}.{proj}.{leaf}"))[0] for x in xs])  # noqa: E731
    return {"w1": rd("gate_proj", wl), "w3": rd("up_proj", wl), "w2": rd("down_proj", wl),
            "s1": rd("gate_proj", sl).view(torch.uint8), "s3": rd("up_proj", sl).view(torch.uint8),
            "s2": rd("down_proj", sl).view(torch.uint8), "s1_2": sc(experts, "gate_proj", gl),
            "s3_2": sc(experts, "up_proj", gl), "s2_2": sc(experts, "down_proj", gl),
            "a13": torch.cat([sc(range(e_all), proj, il) for proj in ("gate_proj", "up_proj")]).max(),
            "a2": sc(range(e_all), "down_proj", il).max()}


def vllm_rank(s: dict, tp_rank: int, tp: int, h_pad: int, i_pad: int) -> dict[str, torch.Tensor]:
    """vLLM's FusedMoE loader cut (w1/w3 rows narrow by I/tp, w2 columns), reorder to [w3 ; w1],
    zero padding, then its per-expert trtllm-gen preparation with FlashInfer's helpers."""
    shard = s["w1"].shape[1] // tp
    rows = slice(tp_rank * shard, (tp_rank + 1) * shard)
    w13, s13 = torch.cat((s["w3"][:, rows], s["w1"][:, rows]), 1), torch.cat((s["s3"][:, rows], s["s1"][:, rows]), 1)
    w2 = s["w2"][:, :, tp_rank * shard // 2:(tp_rank + 1) * shard // 2]
    s2 = s["s2"][:, :, tp_rank * shard // 16:(tp_rank + 1) * shard // 16]
    return vllm_nvfp4_trtllm(pad_w13(w13, i_pad, h_pad // 2), pad_w13(s13, i_pad, h_pad // 16),
                             pad_2d(w2, h_pad, i_pad // 2), pad_2d(s2, h_pad, i_pad // 16),
                             s["s1_2"], s["s2_2"], s["a13"], s["a2"], w3_scale_2=s["s3_2"])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("ep,tp", LAYOUTS)
def test_rank_bytes_equal_vllm_preparation(sources, converted, case, ep, tp):
    out = converted(case, ep, tp)
    m = read_manifest(out)
    h_pad, i_pad = m["padding"]["hidden_size_padded"], m["padding"]["intermediate_size_padded"]
    with Checkpoint(sources(case)) as src:
        for rank in m["ranks"]:
            for layer in m["moe_layers"]:
                s = oracle_experts(src, case, layer["layer"], rank["experts"], m["num_experts"])
                want = vllm_rank(s, rank["tp_rank"], tp, h_pad, i_pad)
                got = rank_tensors(out, rank, layer["prefix"])
                assert sorted(got) == sorted(want)
                for leaf, t in want.items():
                    assert got[leaf].dtype == t.dtype and got[leaf].shape == t.shape, leaf
                    assert torch.equal(got[leaf].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), \
                        (case, rank["rank"], layer["prefix"], leaf)


def dequant(src: Checkpoint, case: str, layer: int, e_all: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All experts of a layer dequantized ModelOpt's / compressed-tensors' way, written out:
    ``gate_up [E, 2I, H]`` (gate first) and ``down [E, H, I]`` float32."""
    s = oracle_experts(src, case, layer, list(range(e_all)), e_all)
    d = lambda w, sc, s2: torch.stack([dequant_nvfp4_ref(w[x], sc[x], s2[x]) for x in range(e_all)])  # noqa: E731
    return (torch.cat((d(s["w1"], s["s1"], s["s1_2"]), d(s["w3"], s["s3"], s["s3_2"])), 1),
            d(s["w2"], s["s2"], s["s2_2"]))


def transformers_moe(src: Checkpoint, case: str, layer: int):
    """transformers' own MoE module for the layer, with the dequantized experts and the router,
    and its shared expert zeroed (it lives in common/): (module, forward(x) -> [T, H])."""
    cfg = text(src.config)
    family = CASES[case][0]
    clean = {k: v for k, v in cfg.items() if k not in ("auto_map", "architectures", "model_type", "quantization_config")}
    if family == "deepseek":
        from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        conf, make, e = DeepseekV3Config(**clean), DeepseekV3MoE, cfg["n_routed_experts"]
    elif family == "qwen3-moe":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        conf, make, e = Qwen3MoeConfig(**clean), Qwen3MoeSparseMoeBlock, cfg["num_experts"]
    else:
        from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

        conf, make, e = Llama4TextConfig(**clean), Llama4TextMoe, cfg["num_local_experts"]
    conf._experts_implementation = "eager"  # the plain per-expert loop, no fused kernels
    moe = make(conf).float()
    gate_up, down = dequant(src, case, layer, e)
    p = moe_prefix(case, layer)
    with torch.no_grad():
        if family == "llama4":
            moe.router.weight.copy_(src.read(f"{p}.router.weight").float())
            moe.experts.gate_up_proj.copy_(gate_up.transpose(1, 2))  # transformers' bmm layout [E, H, 2I]
            moe.experts.down_proj.copy_(down.transpose(1, 2))
        else:
            moe.gate.weight.copy_(src.read(f"{p}.gate.weight").float())
            if family == "deepseek":
                moe.gate.e_score_correction_bias.copy_(src.read(f"{p}.gate.e_score_correction_bias").float())
            moe.experts.gate_up_proj.copy_(gate_up)
            moe.experts.down_proj.copy_(down)
        for name, prm in moe.named_parameters():
            if "shared_expert" in name:
                prm.zero_()
    forward = (lambda x: moe(x)[0]) if family == "llama4" else (lambda x: moe(x[None])[0])
    return moe, forward


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("ep,tp", LAYOUTS[1:])
def test_sum_over_ranks_matches_transformers(sources, converted, case, ep, tp):
    pytest.importorskip("transformers")
    out = converted(case, ep, tp)
    m = read_manifest(out)
    h, h_pad = m["padding"]["hidden_size"], m["padding"]["hidden_size_padded"]
    with Checkpoint(sources(case)) as src:
        for entry in m["moe_layers"]:
            layer, args = entry["layer"], entry["kernel_args"]
            moe, forward = transformers_moe(src, case, layer)
            x = torch.randn(24, h, generator=torch.Generator().manual_seed(layer))
            router = src.read(f"{moe_prefix(case, layer)}.{'router' if CASES[case][0] == 'llama4' else 'gate'}.weight")
            bias = (src.read(f"{moe_prefix(case, layer)}.gate.e_score_correction_bias")
                    if CASES[case][0] == "deepseek" else None)
            ids, weights = route(x @ router.float().T, args, bias)
            with torch.no_grad():
                want = forward(x)
            total = torch.zeros(24, h_pad)
            for rank in m["ranks"]:
                c = from_trtllm(rank_tensors(out, rank, entry["prefix"]))
                total += moe_forward(torch.nn.functional.pad(x, (0, h_pad - h)), expert_fn(c, QuantFormat.NVFP4, "cpu"),
                                     rank["experts"], ids, weights, {"type": "swiglu"},
                                     bool(args.get("apply_weight_on_input")))
            assert not total[:, h:].any()
            assert want.abs().max() > 0.05
            torch.testing.assert_close(total[:, :h], want, rtol=1e-5, atol=1e-5)


# -- what the exports look like on disk ---------------------------------------------------------
def test_deepseek_index_lacks_scales_and_the_shards_hold_them(sources, converted):
    src = sources("deepseek-r1")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {} and not any(k.endswith(".weight_scale_2") for k in index["weight_map"])
    assert all(re.fullmatch(r"model-\d{5}-of-\d{6}\.safetensors", f) for f in set(index["weight_map"].values()))
    with Checkpoint(src) as ck:
        assert "model.layers.1.mlp.experts.0.up_proj.weight_scale_2" in ck.tensors
    qc = json.loads((src / "hf_quant_config.json").read_text())["quantization"]
    assert qc["kv_cache_quant_algo"] == "FP8" and "model.layers.3*" in qc["exclude_modules"]
    # the MTP layer (3) passes through to common/ as it is, BF16
    out = converted("deepseek-r1", 2, 1)
    assert [e["layer"] for e in read_manifest(out)["moe_layers"]] == [1, 2]
    with Checkpoint(src) as ck, Checkpoint(out / "common", with_config=False) as common:
        name = "model.layers.3.mlp.experts.7.down_proj.weight"
        assert common.info(name).dtype == "BF16" and torch.equal(common.read(name), ck.read(name))


def test_v3_0324_fp8_config_is_overruled_by_hf_quant_config(sources, converted):
    cfg = json.loads((sources("deepseek-v3-0324") / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    assert read_manifest(converted("deepseek-v3-0324", 2, 1))["quant_format"] == "nvfp4"


def test_mixed_precision_converts_the_nvfp4_layers_and_passes_the_rest(sources, converted):
    out = converted("deepseek-mixed", 2, 1)
    assert [e["layer"] for e in read_manifest(out)["moe_layers"]] == [1, 2]  # layer 3's experts are FP8
    with Checkpoint(sources("deepseek-mixed")) as ck, Checkpoint(out / "common", with_config=False) as common:
        name = "model.layers.3.mlp.experts.5.gate_proj.weight"
        assert common.info(name).dtype == "F8_E4M3" and torch.equal(common.read(name).view(torch.uint8),
                                                                    ck.read(name).view(torch.uint8))


def test_llama4_flat_export_per_expert_scales(sources, converted):
    src = sources("llama4-flat")
    with Checkpoint(src) as ck:
        assert "lm_head.weight" in ck.tensors and ck.info("model.layers.0.feed_forward.experts.down_proj_weight_scale_2"
                                                          ).shape == (8,)
    m = read_manifest(converted("llama4-flat", 2, 1))
    t = rank_tensors(converted("llama4-flat", 2, 1), m["ranks"][0], m["moe_layers"][0]["prefix"])
    assert len(set(t["output2_scale_scalar"].tolist())) > 1  # one scale per expert, not one per tensor


def test_maverick_converts_every_second_layer(sources, converted):
    m = read_manifest(converted("llama4-maverick", 2, 1))
    assert [e["layer"] for e in m["moe_layers"]] == [1, 3] and m["num_experts"] == 16
    with Checkpoint(converted("llama4-maverick", 2, 1) / "common", with_config=False) as common:
        assert common.info("language_model.model.layers.0.feed_forward.gate_proj.weight").dtype == "U8"


def test_kimi_routing_is_one_group_deepseek(converted):
    args = read_manifest(converted("kimi-k25", 2, 1))["moe_layers"][0]["kernel_args"]
    assert (args["routing_method_type"], args["top_k"], args["n_group"], args["topk_group"]) == (2, 8, 1, 1)
    assert args["routed_scaling_factor"] == pytest.approx(2.827)


def test_qwen3_routing_follows_norm_topk_prob(converted):
    on = read_manifest(converted("qwen3", 2, 1))["moe_layers"][0]["kernel_args"]
    off = read_manifest(converted("qwen3-no-renorm", 2, 1))["moe_layers"][0]["kernel_args"]
    assert (on["routing_method_type"], off["routing_method_type"]) == (4, 0)  # RenormalizeNaive, Default


def test_gate_and_up_input_scales_differ_in_the_split_exports(sources):
    with Checkpoint(sources("qwen3")) as ck:
        p = "model.layers.1.mlp.experts.3"
        assert ck.read(f"{p}.gate_proj.input_scale") != ck.read(f"{p}.up_proj.input_scale")
        assert ck.read(f"{p}.gate_proj.weight_scale_2") != ck.read(f"{p}.up_proj.weight_scale_2")


# -- refusals: one line, what was found and what is supported --------------------------------------
def _edit_config(src, dst, fn, drop=()):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    fn(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    for name in drop:
        (dst / name).unlink()
    return dst


@pytest.mark.parametrize("case,edit,drop,message", [
    ("deepseek-r1", lambda c: c.update(quantization_config={"quant_method": "fp8", "fmt": "e4m3"}),
     ["hf_quant_config.json"], r"quant_method: found 'fp8' \(format 'e4m3'\); supported: mxfp4"),
    ("qwen3-ct", lambda c: c["quantization_config"].update(format="pack-quantized",
                                                          config_groups={"g": {"format": "pack-quantized"}}),
     [], r"expected 'nvfp4-pack-quantized' .* found pack-quantized \(INT4/INT8 packed\)"),
    ("qwen3-ct", lambda c: c.update(quantization_config={"quant_method": "mxfp4"}), [],
     r"qwen3-moe quantized as openai mxfp4: .*MXFP4 from another exporter"),
    ("kimi-k2", lambda c: c.update(num_experts_per_tok=40), [],
     r"cannot route this model: top_k 40 must be in 1..32"),
    ("deepseek-r1", lambda c: c.update(topk_group=5, n_group=8), [],
     r"DeepSeekV3 grouped routing: topk_group 5 > 4"),
    ("qwen3-no-renorm", lambda c: c.update(num_experts_per_tok=12), [],
     r"Default \(softmax, no renormalisation\) routing has no kernel for 16 experts with top_k 12"),
])
def test_refusals_are_one_line(tmp_path, sources, case, edit, drop, message):
    src = _edit_config(sources(case), tmp_path / "src", edit, drop)
    with pytest.raises(MoeshardError, match=message) as e:
        convert(src, tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("routing,experts,message", [
    ({"routing_method_type": 2, "top_k": 40, "n_group": 1, "topk_group": 1}, 2000, "no kernel for 2000 experts"),
    ({"routing_method_type": 2, "top_k": 8, "n_group": 1, "topk_group": 1}, 384, None),  # Kimi-K2
    ({"routing_method_type": 2, "top_k": 8, "n_group": 8, "topk_group": 4}, 256, None),  # DeepSeek-R1
    ({"routing_method_type": 2, "top_k": 8, "n_group": 8, "topk_group": 4}, 512 + 8, "520 experts > 512"),
    ({"routing_method_type": 2, "top_k": 8, "n_group": 4, "topk_group": 2}, 256, "64 experts per group > 32"),
    ({"routing_method_type": 2, "top_k": 8, "n_group": 1, "topk_group": 1, "norm_topk_prob": False}, 384,
     "norm_topk_prob false is not supported"),
    ({"routing_method_type": 4, "top_k": 8}, 128, None),  # Qwen3-30B-A3B
    ({"routing_method_type": 0, "top_k": 8}, 512, "no kernel for 512 experts"),
    ({"routing_method_type": 3, "top_k": 1}, 128, None),  # Llama-4-Maverick
    ({"routing_method_type": 3, "top_k": 1}, 256, "at most 128 experts"),
])
def test_kernel_routing_limits(routing, experts, message):
    from moeshard.layouts.kernel import routing_problems

    problems = routing_problems(routing, experts)
    assert (not problems) if message is None else any(message in p for p in problems), problems


def test_llama4_with_two_experts_per_token_is_refused(tmp_path, sources):
    src = _edit_config(sources("llama4-maverick"), tmp_path / "src",
                       lambda c: c["text_config"].update(num_experts_per_tok=2))
    with pytest.raises(MoeshardError, match="Llama4 routing needs top_k 1, found 2"):
        convert(src, tmp_path / "out")


@pytest.mark.parametrize("case", list(CASES))
def test_validate_passes(converted, case):
    from moeshard.validate import validate

    report = validate(converted(case, 2, 2), tokens=8)
    assert report.passed, [r.detail for r in report.rows if not r.passed]
    assert any(r.rank == "sum" for r in report.rows)


def test_inspect_reads_the_quirky_exports(sources):
    from moeshard.inspect import inspect_path

    info = inspect_path(sources("deepseek-r1"))
    assert info["num_experts"] == 16 and "model.layers.1.mlp.experts.0.up_proj.weight_scale_2" in \
        info["expert_tensors_of_layer"]["tensors"]
    assert inspect_path(sources("kimi-k25"))["routing"]["n_group"] == 1
