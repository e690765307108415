"""Conversion spread over several local processes with torchrun: the same artifact, byte for byte;
a process killed mid-run leaves no manifest, and --resume completes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_reliability import tree_bytes

from moeshard.artifact.manifest import MANIFEST_NAME
from moeshard.artifact.output import FAULT_ENV
from moeshard.convert.pipeline import convert

ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, *args, env=None) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "moeshard",
           "convert", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=600)


def test_three_processes_give_the_single_process_artifact(tmp_path, deepseek_tiny):
    args = ["--ep-size", "4", "--max-shard-size", "60KB", "-q"]
    single = tmp_path / "single"
    convert(deepseek_tiny, single, ep_size=4, max_shard_bytes=60_000)
    out = tmp_path / "multi"
    r = torchrun(3, deepseek_tiny, "-o", out, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert tree_bytes(out) == tree_bytes(single)


def test_killed_process_leaves_no_manifest_and_resume_completes(tmp_path, gpt_oss_tiny):
    args = ["--ep-size", "2", "--tp-size", "2", "--max-shard-size", "60KB", "-q"]
    single = tmp_path / "single"
    convert(gpt_oss_tiny, single, ep_size=2, tp_size=2, max_shard_bytes=60_000)
    out = tmp_path / "multi"
    r = torchrun(2, gpt_oss_tiny, "-o", out, *args, env={FAULT_ENV: "1:KILL"})
    assert r.returncode != 0
    assert not (out / MANIFEST_NAME).exists()
    r = torchrun(2, gpt_oss_tiny, "-o", out, *args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert tree_bytes(out) == tree_bytes(single)
