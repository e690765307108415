"""Atomic artifacts, resume after a crash, the lock, verify, disk space, bad input, fuzzing."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeshard.artifact.manifest import MANIFEST_NAME
from moeshard.artifact.output import FAULT_ENV, LOCK_NAME
from moeshard.artifact.verify import verify
from moeshard.checkpoints.source import Checkpoint
from moeshard.cli import main
from moeshard.convert.pipeline import convert
from moeshard.errors import MoeshardError

ROOT = Path(__file__).resolve().parents[1]


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_cli(*args, env=None) -> subprocess.CompletedProcess:
    e = dict(os.environ, **(env or {}))
    e["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "moeshard", *map(str, args)], capture_output=True, text=True, env=e)


# -- crash, resume, lock --------------------------------------------------------------------------
@pytest.mark.parametrize("sig,code", [("KILL", -9), ("INT", 130)])
def test_resume_after_crash_is_byte_identical(tmp_path, deepseek_tiny, sig, code):
    args = [deepseek_tiny, "--ep-size", "2", "--max-shard-size", "60KB", "-q"]
    clean = tmp_path / "clean"
    assert run_cli("convert", *args, "-o", clean).returncode == 0
    out = tmp_path / "out"
    r = run_cli("convert", *args, "-o", out, env={FAULT_ENV: f"3:{sig}"})
    assert r.returncode == code, r.stderr
    assert not (out / MANIFEST_NAME).exists() and "Traceback" not in r.stderr
    r = run_cli("verify", out)
    assert r.returncode == 1 and "not a moeshard artifact" in r.stderr
    r = run_cli("convert", *args, "-o", out, "--resume", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files_reused"] >= 2  # the safetensors files among the 3 finished
    assert tree_bytes(out) == tree_bytes(clean)
    assert run_cli("verify", out).returncode == 0


def test_second_convert_into_the_same_folder_is_refused(tmp_path, gpt_oss_tiny):
    out = tmp_path / "out"
    out.mkdir()
    with open(out / LOCK_NAME, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(MoeshardError, match="another moeshard convert is writing this folder"):
            convert(gpt_oss_tiny, out, resume=True)
    convert(gpt_oss_tiny, out, resume=True)  # lock released: fine
    assert (out / MANIFEST_NAME).exists() and not (out / LOCK_NAME).exists()


def test_resume_with_other_arguments_is_refused(tmp_path, gpt_oss_tiny, monkeypatch):
    out = tmp_path / "out"
    _disk_full_after(monkeypatch, 1)
    with pytest.raises(MoeshardError):
        convert(gpt_oss_tiny, out, ep_size=2)
    monkeypatch.undo()
    with pytest.raises(MoeshardError, match="--resume: the interrupted conversion used other sources or arguments"):
        convert(gpt_oss_tiny, out, ep_size=4, resume=True)


# -- disk space and write errors ------------------------------------------------------------------
def test_not_enough_disk_is_refused_before_writing(tmp_path, gpt_oss_tiny, monkeypatch):
    from moeshard.artifact import output

    monkeypatch.setattr(output.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(MoeshardError, match=r"needs about 0\.00 GB more, but only 0\.00 GB are free"):
        convert(gpt_oss_tiny, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _disk_full_after(monkeypatch, n: int) -> None:
    """The (n+1)-th output safetensors file fails with ENOSPC, as a full disk does."""
    from moeshard.artifact.writer import SequentialWriter

    real = SequentialWriter._write
    files: list = []

    def write(self, view, offset):
        if self not in files:
            files.append(self)
        if len(files) > n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, view, offset)

    monkeypatch.setattr(SequentialWriter, "_write", write)


def test_disk_full_mid_run_aborts_cleanly_then_resumes(tmp_path, llama4_tiny, monkeypatch):
    out, clean = tmp_path / "out", tmp_path / "clean"
    convert(llama4_tiny, clean, ep_size=2, max_shard_bytes=60_000)
    _disk_full_after(monkeypatch, 2)
    with pytest.raises(MoeshardError, match=r"rank-00001/model-00001-of-00002\.safetensors: write failed \(disk full\)"):
        convert(llama4_tiny, out, ep_size=2, max_shard_bytes=60_000)
    assert not (out / MANIFEST_NAME).exists() and not list(out.rglob("*.tmp"))
    monkeypatch.undo()
    res = convert(llama4_tiny, out, ep_size=2, max_shard_bytes=60_000, resume=True)
    assert res.files_reused == 2 and tree_bytes(out) == tree_bytes(clean)


# -- verify ---------------------------------------------------------------------------------------
def test_verify_reports_each_changed_file(tmp_path, artifacts):
    out = tmp_path / "a"
    shutil.copytree(artifacts("gpt_oss_tiny", 2), out)
    assert all(c.ok for c in verify(out))
    f = out / "rank-00001" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    (out / "common" / "model.safetensors").unlink()
    with open(out / "config.json", "a") as g:
        g.write(" ")
    bad = {c.path: c.problem for c in verify(out) if not c.ok}
    assert set(bad) == {"rank-00001/model.safetensors", "common/model.safetensors", "config.json"}
    assert bad["rank-00001/model.safetensors"].startswith("sha256: expected ")
    assert bad["common/model.safetensors"] == "missing"
    assert bad["config.json"].startswith("size: expected ")
    r = run_cli("verify", out)
    assert r.returncode == 1 and "rank-00001/model.safetensors: sha256" in r.stderr


# -- bad input: one line naming file, tensor, expected, found ------------------------------------
def _edit_tensor(src: Path, name: str, fn) -> None:
    with Checkpoint(src) as ck:  # the shards' headers: ModelOpt's index lacks the scale tensors
        path = src / ck.info(name).file
    t = load_file(path)
    new = fn(t)
    save_file(new, path)


def _json_edit(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _cases():
    gx = "model.layers.0.mlp.experts"
    return {
        "missing config": ("gpt_oss_tiny", lambda s: (s / "config.json").unlink(), r"config\.json: missing"),
        "missing index": ("gpt_oss_tiny", lambda s: (s / "model.safetensors.index.json").unlink(),
                          "no model.safetensors.index.json and no model.safetensors"),
        "index names a missing shard": ("gpt_oss_tiny", lambda s: (s / "model-00002-of-00002.safetensors").unlink(),
                                        "names shard model-00002-of-00002.safetensors, which is missing"),
        "truncated header": ("gpt_oss_tiny", lambda s: _truncate(s / "model-00001-of-00002.safetensors", 30),
                             "model-00001-of-00002.safetensors: truncated safetensors header"),
        "corrupted header": ("deepseek_tiny", lambda s: _scribble(s / "model-00002-of-000005.safetensors", 12, b"}{#"),
                             "model-00002-of-000005.safetensors: unreadable safetensors file"),
        "tensor missing": ("gpt_oss_tiny", lambda s: _drop(s, f"{gx}.down_proj_bias"),
                           f"tensor {gx}.down_proj_bias missing from the checkpoint"),
        "wrong dtype": ("gpt_oss_tiny", lambda s: _edit_tensor(s, f"{gx}.down_proj_scales", lambda t: {
            **t, f"{gx}.down_proj_scales": t[f"{gx}.down_proj_scales"].to(torch.int8)}),
            f"{gx}.down_proj_scales: expected dtype U8, found I8"),
        "wrong shape": ("llama4_tiny", lambda s: _edit_tensor(s, "language_model.model.layers.1.feed_forward.experts.down_proj",
                        lambda t: {**t, "language_model.model.layers.1.feed_forward.experts.down_proj":
                                   t["language_model.model.layers.1.feed_forward.experts.down_proj"][:, :, :100].contiguous()}),
                        r"experts\.down_proj: expected shape \[8, 96, 192\] .* found \[8, 96, 100\]"),
        "config expert count": ("gpt_oss_tiny", lambda s: _json_edit(s / "config.json", lambda d: d.update(num_local_experts=16)),
                                rf"{gx}.gate_up_proj_blocks: expected shape \[16, 448, 5, 16\] \(from config\.json "
                                r"num_local_experts=16, .*found \[8, 448, 5, 16\]"),
        "config hidden size": ("deepseek_tiny", lambda s: _json_edit(s / "config.json", lambda d: d.update(hidden_size=256)),
                               r"expected shape \[192, 128\] \(from config\.json hidden_size=256"),
        "unknown family": ("gpt_oss_tiny", lambda s: _json_edit(s / "config.json", lambda d: d.update(model_type="mixtral")),
                           "unsupported checkpoint: found model_type 'mixtral'; supported: gpt_oss"),
        "unknown quant method": ("gpt_oss_tiny", lambda s: _json_edit(
            s / "config.json", lambda d: d["quantization_config"].update(quant_method="fp8")),
            "quantization_config.quant_method: found 'fp8' .*; supported: mxfp4"),
        "NaN block scale": ("deepseek_tiny", lambda s: _edit_tensor(s, "model.layers.2.mlp.experts.5.up_proj.weight_scale",
                            lambda t: {**t, "model.layers.2.mlp.experts.5.up_proj.weight_scale": _nan_e4m3(
                                t["model.layers.2.mlp.experts.5.up_proj.weight_scale"])}),
                            r"experts\.5\.up_proj\.weight_scale: expected finite E4M3 block scales, found NaN \(0x7F\)"),
        "inf weight_scale_2": ("llama4_tiny", lambda s: _edit_tensor(
            s, "language_model.model.layers.0.feed_forward.experts.down_proj_weight_scale_2",
            lambda t: {**t, "language_model.model.layers.0.feed_forward.experts.down_proj_weight_scale_2":
                       torch.tensor(float("inf"))}),
            "down_proj_weight_scale_2: expected a positive finite scale, found inf"),
        "ep size does not divide": ("gpt_oss_tiny", None, "8 experts cannot be split evenly over --ep-size 3"),
        "tp size does not divide": ("deepseek_tiny", None, "cannot be cut into --tp-size 5"),
    }


def _truncate(path: Path, n: int) -> None:
    path.write_bytes(path.read_bytes()[:n])


def _scribble(path: Path, at: int, data: bytes) -> None:
    b = bytearray(path.read_bytes())
    b[at:at + len(data)] = data
    path.write_bytes(bytes(b))


def _drop(src: Path, name: str) -> None:
    _edit_tensor(src, name, lambda t: {k: v for k, v in t.items() if k != name})
    _json_edit(src / "model.safetensors.index.json", lambda d: d["weight_map"].pop(name))


def _nan_e4m3(t: torch.Tensor) -> torch.Tensor:
    b = t.view(torch.uint8).clone()
    b[3, 1] = 0x7F
    return b.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("case", list(_cases()))
def test_bad_input_is_one_line_and_leaves_no_artifact(request, tmp_path, monkeypatch, capsys, case):
    fixture, mutate, message = _cases()[case]
    src = tmp_path / "src"
    shutil.copytree(request.getfixturevalue(fixture), src)
    extra = {"ep size does not divide": ["--ep-size", "3"], "tp size does not divide": ["--tp-size", "5"]}.get(case, [])
    if mutate:
        mutate(src)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["moeshard", "convert", str(src), "-o", str(out), "-q", *extra])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" not in err
    first = err.splitlines()[0]
    assert first.startswith("moeshard: error: ") and len(err.splitlines()) == 1, err
    import re

    assert re.search(message, first), first
    assert not (out / MANIFEST_NAME).exists()


# -- fuzz -----------------------------------------------------------------------------------------
def _mutate(rng: random.Random, src: Path) -> str:
    shards = sorted(src.glob("*.safetensors"))
    f = rng.choice(shards)
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    kind = rng.choice(["header-byte", "truncate", "dtype", "shape", "data-bytes", "index", "config"])
    if kind == "header-byte":
        data[8 + rng.randrange(n)] = rng.randrange(256)
    elif kind == "truncate":
        data = data[: rng.randrange(len(data))]
    elif kind in ("dtype", "shape"):
        header = data[8:8 + n].decode(errors="replace")
        if kind == "dtype":
            a, b = rng.choice([('"U8"', '"I8"'), ('"F8_E4M3"', '"BF16"'), ('"BF16"', '"F16"'), ('"F32"', '"I32"')])
        else:
            a = rng.choice(["[8,", "[16,", "[192,", ",16]", ",5]"])
            b = rng.choice(["[9,", "[4,", ",15]", ",17]"])
        header = header.replace(a, b, 1)
        raw = header.encode()
        data = bytearray(len(raw).to_bytes(8, "little")) + raw + data[8 + n:]
    elif kind == "data-bytes":
        for _ in range(rng.randrange(1, 20)):
            data[8 + n + rng.randrange(len(data) - 8 - n)] = rng.randrange(256)
    elif kind == "index":
        idx = src / "model.safetensors.index.json"
        text = idx.read_text()
        i = rng.randrange(len(text))
        idx.write_text(text[:i] + text[i + rng.randrange(1, 5):])
        return kind
    else:
        cfg = json.loads((src / "config.json").read_text())
        holder = cfg.get("text_config", cfg)
        key = rng.choice(sorted(k for k, v in holder.items() if isinstance(v, int) and not isinstance(v, bool)))
        holder[key] = rng.choice([-1, 0, 3, 10**9, "x", None, 2.5])
        (src / "config.json").write_text(json.dumps(cfg))
        return kind
    f.write_bytes(bytes(data))
    return kind


@pytest.mark.parametrize("family", ["gpt_oss_tiny", "deepseek_tiny", "llama4_tiny"])
def test_fuzzed_checkpoints_convert_or_fail_cleanly(request, tmp_path, family):
    rng = random.Random(f"moeshard-{family}")
    base = request.getfixturevalue(family)
    outcomes = {"ok": 0, "error": 0}
    for i in range(60):
        src, out = tmp_path / f"s{i}", tmp_path / f"o{i}"
        shutil.copytree(base, src)
        kind = _mutate(rng, src)
        try:
            convert(src, out, ep_size=2)
        except MoeshardError as e:
            assert str(e) and "\n" not in str(e), (kind, str(e))
            assert not (out / MANIFEST_NAME).exists(), kind
            assert not out.exists() or not list(out.rglob("*.tmp")), kind
            outcomes["error"] += 1
        else:
            assert all(c.ok for c in verify(out)), kind
            outcomes["ok"] += 1
        shutil.rmtree(src)
        shutil.rmtree(out, ignore_errors=True)
    assert outcomes["error"] > 0 and outcomes["ok"] > 0, outcomes


@pytest.mark.parametrize("family", ["gpt_oss_tiny", "deepseek_tiny"])
def test_chunked_streaming_gives_the_same_bytes(request, tmp_path, family, monkeypatch):
    """One expert per chunk through one-page staging buffers (many writes in flight, buffers
    reused across files) against whole layers at once; every file's hash is its own."""
    from moeshard.artifact import writer

    src = request.getfixturevalue(family)
    convert(src, tmp_path / "b", ep_size=2, tp_size=2)
    monkeypatch.setattr(writer, "BUFFER_BYTES", writer.ALIGN)
    convert(src, tmp_path / "a", ep_size=2, tp_size=2, chunk_bytes=1)
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")
    assert all(c.ok for c in verify(tmp_path / "a"))
