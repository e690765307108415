"""On a CUDA GPU: moeshard's layout transform of one real-size layer against the per-expert loop
serving engines run today (FlashInfer's helpers with an index cache, as vLLM does for GPT-OSS).

Both start from the same canonical tensors already on the GPU and end with the kernel tensors
on the GPU; both are checked byte-equal. Reports cold (first call, index built) and warm
(median of repeats) milliseconds.

    python bench/transform_gpu.py --source /tmp/bench/gpt-oss-120b-src
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _reference import swap_every_two_rows  # noqa: E402

from moeshard.convert.families import detect  # noqa: E402
from moeshard.convert.source import Checkpoint  # noqa: E402
from moeshard.layouts import trtllm  # noqa: E402
from moeshard.layouts.canonical import pad_experts  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, list[float], object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    cold = (time.perf_counter() - t0) * 1e3
    warm = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        warm.append((time.perf_counter() - t0) * 1e3)
    return cold, warm, out


def per_expert_loop(w13, s13, b13, w2, s2, b2, cache: dict) -> dict[str, torch.Tensor]:
    """vLLM's GPT-OSS preparation on the GPU: pairwise swap, then per expert
    get_w2_permute_indices_with_cache + block_scale_interleave (CUDA)."""
    from flashinfer import block_scale_interleave
    from flashinfer.fused_moe.core import get_w2_permute_indices_with_cache

    w13, s13, b13 = swap_every_two_rows(w13, -2), swap_every_two_rows(s13, -2), swap_every_two_rows(b13, -1)
    out = {k: [] for k in ("w1", "s1", "b1", "w2", "s2", "b2")}
    for i in range(w13.shape[0]):
        idx = get_w2_permute_indices_with_cache(cache, w13[i], 128)
        out["w1"].append(w13[i][idx])
        idx = get_w2_permute_indices_with_cache(cache, s13[i], 128, num_elts_per_sf=16)
        out["s1"].append(block_scale_interleave(s13[i][idx].contiguous()))
        idx = get_w2_permute_indices_with_cache(cache, b13[i].reshape(-1, 1), 128)
        out["b1"].append(b13[i][idx])
        idx = get_w2_permute_indices_with_cache(cache, w2[i], 128)
        out["w2"].append(w2[i][idx])
        idx = get_w2_permute_indices_with_cache(cache, s2[i], 128, num_elts_per_sf=16)
        out["s2"].append(block_scale_interleave(s2[i][idx].contiguous()))
        idx = get_w2_permute_indices_with_cache(cache, b2[i].reshape(-1, 1), 128)
        out["b2"].append(b2[i][idx])
    return {k: torch.stack(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, required=True, help="a gpt-oss checkpoint (real sizes)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json-out", type=Path, default=None)
    a = ap.parse_args()
    with Checkpoint(a.source) as ckpt:
        adapter = detect(ckpt)
        spec = adapter.spec(ckpt)
        layer = spec.moe_layers[0]
        c = adapter.read_experts(ckpt, spec, layer, 0, spec.num_experts)
        p = spec.prefix(layer)
        raw = {leaf: ckpt.read(f"{p}.{leaf}").cuda() for leaf in
               ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
                "down_proj_scales", "down_proj_bias")}
    hp, ip = 3072, 3072
    c = c.replace(**{k: v.cuda() for k, v in c.__dict__.items() if isinstance(v, torch.Tensor)})
    # The engines' input: the checkpoint copied into zero params of the padded shape.
    e = spec.num_experts
    w13 = torch.zeros(e, 2 * ip, hp // 2, dtype=torch.uint8, device="cuda")
    s13 = torch.zeros(e, 2 * ip, hp // 32, dtype=torch.uint8, device="cuda")
    b13 = torch.zeros(e, 2 * ip, device="cuda")
    w2 = torch.zeros(e, hp, ip // 2, dtype=torch.uint8, device="cuda")
    s2 = torch.zeros(e, hp, ip // 32, dtype=torch.uint8, device="cuda")
    b2 = torch.zeros(e, hp, device="cuda")
    h, i = spec.hidden_size, spec.intermediate_size
    w13[:, : 2 * i, : h // 2] = raw["gate_up_proj_blocks"].flatten(-2)
    s13[:, : 2 * i, : h // 32] = raw["gate_up_proj_scales"]
    b13[:, : 2 * i] = raw["gate_up_proj_bias"].float()
    w2[:, :h, : i // 2] = raw["down_proj_blocks"].flatten(-2)
    s2[:, :h, : i // 32] = raw["down_proj_scales"]
    b2[:, :h] = raw["down_proj_bias"].float()

    c_unpadded = c
    c = pad_experts(c, hp, ip)
    trtllm._row_permutation.cache_clear()
    m_cold, m_warm, ours = timed(lambda: trtllm.to_trtllm(c), a.repeats)
    f_cold_ms, f_warm_ms, fused = timed(lambda: trtllm.to_trtllm_padded(c_unpadded, hp, ip), a.repeats)
    assert all(torch.equal(fused[k].view(torch.uint8), ours[k].view(torch.uint8)) for k in ours)
    cache: dict = {}
    f_cold, f_warm, theirs = timed(lambda: per_expert_loop(w13, s13, b13, w2, s2, b2, cache), a.repeats)
    same = all(torch.equal(ours[k].view(torch.uint8).flatten(), theirs[j].view(torch.uint8).flatten()) for k, j in
               (("gemm1_weights", "w1"), ("gemm1_weights_scale", "s1"), ("gemm2_weights", "w2"),
                ("gemm2_weights_scale", "s2"))) and torch.equal(ours["gemm1_bias"], theirs["b1"]) \
        and torch.equal(ours["gemm2_bias"], theirs["b2"])
    rows = [{"method": "moeshard to_trtllm on padded experts (batched gathers)", "cold_ms": round(m_cold, 2),
             "warm_ms": round(statistics.median(m_warm), 2)},
            {"method": "moeshard to_trtllm_padded (fused padding, as convert runs it)", "cold_ms": round(f_cold_ms, 2),
             "warm_ms": round(statistics.median(f_warm_ms), 2)},
            {"method": "FlashInfer per-expert loop + index cache (vLLM)", "cold_ms": round(f_cold, 2),
             "warm_ms": round(statistics.median(f_warm), 2)}]
    print(f"gpt-oss-120b layer, {e} experts, padded {hp}, {torch.cuda.get_device_name()}; byte-equal: {same}")
    print("method | cold ms | warm ms (median)")
    for r in rows:
        print(f"{r['method']} | {r['cold_ms']} | {r['warm_ms']}")
    if a.json_out:
        a.json_out.write_text(json.dumps({"rows": rows, "byte_equal": same}, indent=2))


if __name__ == "__main__":
    main()
