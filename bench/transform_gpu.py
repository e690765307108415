"""On a CUDA GPU: moeshard's layout transform of one real-size layer against the per-expert loop
serving engines run today (FlashInfer's helpers with an index cache, as vLLM does for GPT-OSS).

All start from tensors already on the GPU (moeshard's canonical experts, or the checkpoint's own
tensors; the engines' loop from the checkpoint's tensors) and end with the kernel tensors on the
GPU; all are checked byte-equal. Reports cold (first call, index built) and warm (median of
repeats) milliseconds.

    python bench/transform_gpu.py --source /tmp/bench/gpt-oss-120b-src
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _common import report

from moeshard.checkpoints.families import detect, read_experts
from moeshard.checkpoints.source import Checkpoint
from moeshard.layouts import trtllm
from moeshard.layouts.canonical import pad_experts
from moeshard.validate.engines import engine_interleave, vllm_gpt_oss_trtllm

LEAVES = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks", "down_proj_scales",
          "down_proj_bias")


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
        c = read_experts(adapter, ckpt, spec, layer, 0, spec.num_experts)
        raw = [ckpt.read(f"{spec.prefix(layer)}.{leaf}").cuda() for leaf in LEAVES]
        fields = {}  # kind -> (source tensor, row map) on the GPU, as convert --device cuda reads them
        for kind, field in trtllm.KERNEL_FIELDS.items():
            src, rows = adapter.read_raw(ckpt, spec, layer, field, 0, spec.num_experts)
            fields[kind] = (src.cuda(), None if rows is None else rows.cuda())
    hp = ip = 3072
    c = c.replace(**{k: v.cuda() for k, v in c.__dict__.items() if isinstance(v, torch.Tensor)})
    padded = pad_experts(c, hp, ip)
    trtllm._row_permutation.cache_clear()
    m_cold, m_warm, ours = timed(lambda: trtllm.to_trtllm(padded), a.repeats)
    f_cold, f_warm, fused = timed(lambda: trtllm.to_trtllm_padded(c, hp, ip), a.repeats)
    s_cold, s_warm, direct = timed(lambda: {k: trtllm.trtllm_tensor(k, src, rows, hp, ip, 32)
                                            for k, (src, rows) in fields.items()}, a.repeats)
    cache: dict = {}  # the engines' index cache, kept across calls as vLLM keeps it per layer
    v_cold, v_warm, theirs = timed(lambda: vllm_gpt_oss_trtllm(*raw, hp, ip, interleave=engine_interleave,
                                                               cache=cache), a.repeats)
    same = all(torch.equal(t.view(torch.uint8).flatten(), theirs[k].view(torch.uint8).flatten())
               for res in (ours, fused, direct) for k, t in res.items())
    med = lambda xs: round(statistics.median(xs), 2)  # noqa: E731
    report([{"method": "moeshard to_trtllm on padded experts (batched gathers)", "cold_ms": round(m_cold, 2),
             "warm_ms": med(m_warm)},
            {"method": "moeshard to_trtllm_padded (canonical experts, padding fused)", "cold_ms": round(f_cold, 2),
             "warm_ms": med(f_warm)},
            {"method": "moeshard from the source tensors (one row map each, as convert --device cuda runs)",
             "cold_ms": round(s_cold, 2), "warm_ms": med(s_warm)},
            {"method": "vLLM: FlashInfer per-expert loop + index cache", "cold_ms": round(v_cold, 2),
             "warm_ms": med(v_warm)}], a.json_out,
           f"gpt-oss-120b layer, {spec.num_experts} experts, padded {hp}, {torch.cuda.get_device_name()}; "
           f"byte-equal: {same}")


if __name__ == "__main__":
    main()
