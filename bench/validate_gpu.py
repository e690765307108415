"""``moeshard validate --device cuda`` on a multi-layer real-size artifact, layer by layer, against
the time to read the same bytes (the read-only limit), page cache warm and cold, in one run.

Cases (generated on the spot, converted with --ep-size 8): gpt-oss-120b with 4 MoE layers
(128 experts, H = I = 2880), and DeepSeek-R1 layer sizes with 4 MoE layers (256 experts,
H 7168, I 2048; one dense layer and no MTP layer, whose 22 GB of BF16 experts validate never
reads, so that source and artifact fit the disk). Every expert of every rank is checked, 64
tokens, with the default FlashInfer layout sample (2 experts per rank and layer).

Per layer: ``read_s``, the layer's source expert bytes and its artifact bytes of every rank read
into memory (``pread``, merged ranges, on as many threads as validate reads with: the limit for
that reader); ``validate_s``, the layer's share of one ``validate`` over all layers (from its
report); their ratio. Three validate runs in one process: ``first``, the process's first, page
cache warm (it carries the one-time costs: pinned host buffers allocated, CUDA kernels loaded);
``warm``, the same again; ``cold``, the files' pages dropped (``/proc/sys/vm/drop_caches`` when
allowed, else ``posix_fadvise(DONTNEED)`` per file) before the read pass and again before the
validate pass. Also: peak GPU memory, the growth of host RSS during each run (peak minus before),
FlashInfer's first-call JIT (excluded from the times), and the cost of the layout check (the
``warm`` run against a fourth run with it off). Prints a table; ``--json-out`` writes it with the
details.

    python bench/validate_gpu.py --work /tmp/vbench --json-out validate-gpu.json
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from _common import report

from moeshard.artifact.manifest import Manifest, artifact_file
from moeshard.checkpoints.source import Checkpoint
from moeshard.convert.pipeline import convert
from moeshard.fixtures import deepseek, fixture
from moeshard.validate import validate
from moeshard.validate.check import readers

CASES = {"gpt-oss-120b": ("gpt-oss", "gpt-oss-120b", 4, {}),
         "deepseek-r1": ("deepseek", "deepseek-r1", 5, {"first_k_dense_replace": 1, "mtp": False})}
TINY = {"gpt-oss-120b": "tiny", "deepseek-r1": "tiny"}  # --tiny: the same run on tiny presets (a smoke test)
BUF = 64 << 20


def layer_ranges(src: Path, out: Path, m: Manifest, layer: int) -> list[tuple[Path, int, int]]:
    """(file, offset, length) of the layer's source experts and of its artifact tensors on every
    rank, adjacent ranges merged."""
    ranges = []
    with Checkpoint(src, partial=True) as c:
        pat = re.compile(rf"(^|\.)layers\.{layer}\.(mlp|feed_forward)\.experts\.")
        ranges += [(c.root / t.file, t.offset, t.nbytes) for n, t in c.tensors.items() if pat.search(n)]
    prefix = m.layer(layer).prefix + "."
    for r in m.ranks:
        with Checkpoint(artifact_file(out, r.folder), with_config=False) as c:
            ranges += [(c.root / t.file, t.offset, t.nbytes) for n, t in c.tensors.items() if n.startswith(prefix)]
    merged: list[list] = []
    for f, a, n in sorted(ranges):
        if merged and merged[-1][0] == f and merged[-1][1] + merged[-1][2] == a:
            merged[-1][2] += n
        else:
            merged.append([f, a, n])
    return [tuple(x) for x in merged]


def read_ranges(ranges: list[tuple[Path, int, int]], threads: int) -> tuple[int, float]:
    """Read every range into a reused buffer per thread; (bytes, seconds)."""
    pieces = [(f, a + k, min(BUF, n - k)) for f, a, n in ranges for k in range(0, n, BUF)]

    def work(part):
        buf, fds, total = bytearray(BUF), {}, 0
        for f, a, n in part:
            fd = fds.get(f) or fds.setdefault(f, os.open(f, os.O_RDONLY))
            view, got = memoryview(buf)[:n], 0
            while got < n:
                got += os.preadv(fd, [view[got:]], a + got)
            total += n
        for fd in fds.values():
            os.close(fd)
        return total

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(work, [pieces[k::threads] for k in range(threads)]))
    return total, time.perf_counter() - t0


def drop(folders: list[Path]) -> str:
    """Drop the folders' pages from the page cache; how."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for folder in folders:
            for f in folder.rglob("*"):
                if f.is_file():
                    fd = os.open(f, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
        return "fadvise"


class PeakRss:
    """Peak resident set of this process while in the with-block (sampled every 20 ms), MB."""

    def __enter__(self):
        self.peak, self._stop = 0, threading.Event()
        self.before = self._rss()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    @staticmethod
    def _rss() -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) // 1024

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.02)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def timed_validate(out: Path, tokens: int, device: str, **kw) -> tuple[object, float, int, int]:
    """One validate over every layer: (report, seconds, peak GPU MB, host RSS growth MB)."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with PeakRss() as rss:
        t0 = time.perf_counter()
        rep = validate(out, tokens=tokens, backend="decode", device=device, **kw)
        if cuda:
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
    return rep, secs, (torch.cuda.max_memory_allocated() >> 20) if cuda else 0, rss.peak - rss.before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/moeshard-vbench"))
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--keep", action="store_true", help="keep each case's files (default: removed after it)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny presets: check that the script runs")
    a = ap.parse_args()
    t0 = time.perf_counter()
    from moeshard.validate.engines import engine_interleave

    engine_interleave(torch.zeros(128, 4, dtype=torch.uint8, device=a.device))  # FlashInfer's JIT build, once
    details = {"gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
               "flashinfer_first_call_s": round(time.perf_counter() - t0, 1), "readers": readers(a.device), "cases": {}}
    rows = []
    for name in a.cases.split(","):
        family, preset, layers, overrides = CASES[name]
        preset = TINY[name] if a.tiny else preset
        src, out = a.work / f"{name}-src", a.work / f"{name}-out"
        t0 = time.perf_counter()
        if not src.exists():
            if overrides and not a.tiny:
                deepseek.PRESETS[preset] = {**deepseek.PRESETS[preset], **overrides}
            fixture(family, preset, src, layers=layers)
        t_fix = time.perf_counter() - t0
        res = convert(src, out, ep_size=8, overwrite=True)
        m = res.manifest
        moe = [e.layer for e in m.moe_layers]
        ranges = {x: layer_ranges(src, out, m, x) for x in moe}
        d = {"fixture_s": round(t_fix, 1), "convert_s": round(res.seconds, 1), "layers": moe}
        timing: dict[str, dict] = {}
        for run in ("first", "warm", "cold"):  # first: the process's first validate (one-time costs)
            if run == "first":
                for x in moe:
                    read_ranges(ranges[x], readers(a.device))  # into the page cache
            if run == "cold":
                d["evict"] = drop([src, out])
            reads = {x: read_ranges(ranges[x], readers(a.device)) for x in moe}
            if run == "cold":
                drop([src, out])
            rep, secs, gpu_mb, rss_mb = timed_validate(out, a.tokens, a.device)
            timing[run] = {"reads": reads, "report": rep, "seconds": secs}
            d[f"{run}_validate_total_s"] = round(secs, 2)
            d[f"{run}_peak_gpu_mb"], d[f"{run}_rss_growth_mb"] = gpu_mb, rss_mb
            d[f"{run}_passed"] = rep.passed
        _, secs_no_layout, _, _ = timed_validate(out, a.tokens, a.device, layout_sample=0)
        d["warm_validate_total_no_layout_check_s"] = round(secs_no_layout, 2)
        d["layout_check_cost_s"] = round(timing["warm"]["seconds"] - secs_no_layout, 2)
        d["coverage"] = timing["warm"]["report"].coverage

        def row_of(read: dict, val: dict) -> dict:
            return {f"{run}_{k}": round(v, 2) for run in ("first", "warm", "cold")
                    for k, v in (("read_s", read[run]), ("validate_s", val[run]), ("ratio", val[run] / read[run]))
                    if not (run == "first" and k == "read_s")}

        for x in moe:
            read = {run: timing[run]["reads"][x][1] for run in timing}
            val = {run: next(r["seconds"] for r in timing[run]["report"].layers if r["layer"] == x) for run in timing}
            rows.append({"case": name, "layer": x, **row_of(read, val), "gb": round(timing["warm"]["reads"][x][0] / 1e9, 2)})
        read = {run: sum(s for _, s in timing[run]["reads"].values()) for run in timing}
        rows.append({"case": name, "layer": "all", **row_of(read, {run: timing[run]["seconds"] for run in timing}),
                     "gb": round(sum(n for n, _ in timing["warm"]["reads"].values()) / 1e9, 2)})
        details["cases"][name] = d
        if not a.keep:
            shutil.rmtree(src)
            shutil.rmtree(out)
    details["peak_rss_process_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
    report(rows, None, title=f"validate, every expert of 8 ranks, {a.tokens} tokens, on {details['gpu']}")
    print(details)
    if a.json_out:
        import json

        a.json_out.write_text(json.dumps({"rows": rows, "details": details}, indent=2, default=str))


if __name__ == "__main__":
    main()
