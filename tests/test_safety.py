"""Probes for data safety and security: outputs that overlap the source, --overwrite and demo
removing only what moeshard made, symlinks and traversal in checkpoints and manifests, push
uploading only what the manifest lists, no local paths published, absurd config values, and the
rough edges of the CLI (one-line errors, leftovers, messages)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_hub import hub_cache
from test_reliability import run_cli, tree_bytes

import moeshard
from moeshard.artifact.manifest import MANIFEST_NAME, read_manifest
from moeshard.artifact.output import FAULT_ENV, LOCK_NAME, STATE_DIR
from moeshard.artifact.verify import verify
from moeshard.cli import main
from moeshard.convert.pipeline import convert
from moeshard.errors import MoeshardError
from moeshard.validate import validate


@pytest.fixture
def src(tmp_path, gpt_oss_tiny) -> Path:
    """A private copy of the tiny GPT-OSS checkpoint (tests may break it)."""
    s = tmp_path / "src"
    shutil.copytree(gpt_oss_tiny, s)
    return s


def one_line(monkeypatch, capsys, *args) -> tuple[int, str]:
    """Run the CLI's main(); its exit status and its stderr, which must be exactly one line."""
    monkeypatch.setattr(sys, "argv", ["moeshard", *map(str, args)])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return e.value.code, err.strip()


# -- 1. data loss ----------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["same", "inside", "contains", "symlink", "dotdot"])
def test_output_overlapping_the_source_is_refused_before_anything(tmp_path, gpt_oss_tiny, where):
    box = tmp_path / "sb"
    s = box / "src"
    shutil.copytree(gpt_oss_tiny, s)
    before = tree_bytes(box)
    out = {"same": s, "inside": s / "out", "contains": box, "symlink": tmp_path / "link",
           "dotdot": s / ".." / "src"}[where]
    if where == "symlink":
        os.symlink(s, out)
    with pytest.raises(MoeshardError, match="overlaps the source") as e:
        convert(s, out, overwrite=True)
    assert str(s.resolve()) in str(e.value) or str(s) in str(e.value)
    assert tree_bytes(box) == before and not (s / "out").exists()


def test_output_inside_a_hub_cache_is_refused(tmp_path, gpt_oss_tiny, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    repo = hub_cache(tmp_path / "hub", "org/tiny", gpt_oss_tiny)
    before = tree_bytes(repo)
    for out in (repo, repo / "snapshots", tmp_path / "hub"):
        with pytest.raises(MoeshardError, match="overlaps the source"):
            convert("org/tiny", out, overwrite=True, cache_dir=tmp_path / "hub")
    assert tree_bytes(repo) == before


def test_overwrite_refuses_a_folder_with_files_moeshard_did_not_make(tmp_path, src):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "x").write_text("mine too")
    with pytest.raises(MoeshardError, match=r"notes\.txt.*not made by moeshard"):
        convert(src, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "sub" / "x").exists()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "sub"]


def test_overwrite_replaces_only_a_previous_artifact_and_says_so(tmp_path, src):
    out = tmp_path / "out"
    convert(src, out, ep_size=2)
    (out / "rank-00001" / "stray.bin").write_text("mine")
    with pytest.raises(MoeshardError, match=r"rank-00001/stray\.bin"):
        convert(src, out, ep_size=4, overwrite=True)
    assert (out / "rank-00001" / "stray.bin").exists() and (out / MANIFEST_NAME).exists()
    (out / "rank-00001" / "stray.bin").unlink()
    res = convert(src, out, ep_size=4, overwrite=True)
    assert "rank-00000" in res.replaced and "moeshard.json" in res.replaced
    assert len(read_manifest(out)["ranks"]) == 4 and not (out / "rank-00004").exists()
    assert all(c.ok for c in verify(out))


def test_demo_never_removes_what_it_did_not_make(tmp_path):
    from typer.testing import CliRunner

    from moeshard.cli import app

    d = tmp_path / "demo"
    d.mkdir()
    (d / "thesis.tex").write_text("years of work")
    r = CliRunner().invoke(app, ["demo", "-o", str(d), "--json"])
    assert r.exit_code != 0 and (d / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in d.iterdir()) == ["thesis.tex"]
    d2 = tmp_path / "demo2"
    for _ in range(2):  # a second run replaces the first run's output
        r = CliRunner().invoke(app, ["demo", "-o", str(d2), "--json"])
        assert r.exit_code == 0, r.output
    (d2 / "source" / "mine.txt").write_text("x")
    r = CliRunner().invoke(app, ["demo", "-o", str(d2), "--json"])
    assert r.exit_code != 0 and (d2 / "source" / "mine.txt").exists()


# -- 2. nothing from outside the checkpoint, nothing stray to the Hub -------------------------------
def test_config_symlinked_outside_the_checkpoint_is_refused(tmp_path, src):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    os.symlink(secret, src / "tokenizer.json")
    with pytest.raises(MoeshardError, match=r"tokenizer\.json: a symlink to .* outside the checkpoint"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_symlink_inside_the_checkpoint_is_followed(tmp_path, src):
    (src / "meta").mkdir()
    (src / "meta" / "tokenizer.json").write_text('{"version": "1.0"}')
    os.symlink(Path("meta") / "tokenizer.json", src / "tokenizer.json")
    convert(src, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"version": "1.0"}'


def test_hub_snapshot_symlink_outside_the_repo_cache_is_refused(tmp_path, gpt_oss_tiny, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    repo = hub_cache(tmp_path / "hub", "org/tiny", gpt_oss_tiny)
    secret = tmp_path / "secret.txt"
    secret.write_text("token=hf_xxx")
    snap = next((repo / "snapshots").iterdir())
    os.symlink(secret, snap / "tokenizer.json")
    with pytest.raises(MoeshardError, match=r"tokenizer\.json: a symlink to .* outside"):
        convert("org/tiny", tmp_path / "out", cache_dir=tmp_path / "hub")


@pytest.mark.parametrize("bad", ["absolute", "dotdot"])
def test_weight_map_outside_the_checkpoint_is_refused_before_opening(tmp_path, src, bad, monkeypatch):
    other = tmp_path / "elsewhere"
    other.mkdir()
    shutil.copy(src / "model-00002-of-00002.safetensors", other / "x.safetensors")
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    name = next(iter(idx["weight_map"]))
    idx["weight_map"][name] = str(other / "x.safetensors") if bad == "absolute" else "../elsewhere/x.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (opened.append(str(p)), real_open(p, *a, **k))[1])
    with pytest.raises(MoeshardError, match=r"weight_map: .*outside the checkpoint"):
        convert(src, tmp_path / "out")
    assert not any("elsewhere" in p for p in opened)


def test_a_non_safetensors_file_does_not_leak_its_bytes(tmp_path, src):
    shard = src / "model-00002-of-00002.safetensors"
    shard.write_bytes(b"SECRETPWsome more private text")
    with pytest.raises(MoeshardError) as e:
        convert(src, tmp_path / "out")
    leaked = str(int.from_bytes(b"SECRETPW", "little"))
    assert leaked not in str(e.value) and "SECRETPW" not in str(e.value)


@pytest.fixture
def fake_hub(monkeypatch):
    """HfApi with the commit endpoints replaced: records what would be uploaded."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import CommitInfo

    made = {}

    def create_commit(self, repo_id, operations, commit_message, **kw):
        made["files"] = {}
        for op in operations:
            f = op.path_or_fileobj
            made["files"][op.path_in_repo] = f if isinstance(f, bytes) else Path(f).read_bytes()
        made["message"] = commit_message + "\n" + (kw.get("commit_description") or "")
        return CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/abc", commit_message=commit_message,
                          commit_description="", oid="abc", pr_url=None)

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: None)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: pytest.fail("upload_folder uploads the whole folder"))
    return made


def test_push_uploads_exactly_the_manifest_and_writes_nothing(tmp_path, src, fake_hub):
    from moeshard.artifact.push import push

    out = tmp_path / "out"
    convert(src, out, ep_size=2)
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$secret")
    (out / ".env").write_text("HF_TOKEN=hf_secret")
    os.symlink(secret, out / "shadow")
    os.symlink(secret, out / "README.md")  # a link: push must not write through it
    before = tree_bytes(out)
    push(out, "me/x")
    m = read_manifest(out)
    listed = {f["path"] for r in m["ranks"] for f in r["files"] + [r["index"]]}
    listed |= {f["path"] for f in m["common"]["files"] + [m["common"]["index"]]} | {f["path"] for f in m["copied"]}
    assert set(fake_hub["files"]) == listed | {"moeshard.json", "README.md"}
    assert b"moeshard.load_rank" in fake_hub["files"]["README.md"]
    assert secret.read_text() == "root:$6$secret" and tree_bytes(out) == before
    assert str(tmp_path) not in fake_hub["message"]


@pytest.mark.parametrize("change", ["size", "symlink"])
def test_push_refuses_files_changed_since_the_manifest(tmp_path, src, fake_hub, change):
    from moeshard.artifact.push import push

    out = tmp_path / "out"
    convert(src, out, ep_size=2)
    f = out / "rank-00001" / "model.safetensors"
    if change == "size":
        with open(f, "ab") as g:
            g.write(b"x")
    else:
        secret = tmp_path / "secret"
        secret.write_bytes(f.read_bytes())  # same size
        f.unlink()
        os.symlink(secret, f)
    with pytest.raises(MoeshardError, match=r"rank-00001/model\.safetensors"):
        push(out, "me/x")
    assert "files" not in fake_hub


def test_manifest_publishes_no_local_path(tmp_path, src, gpt_oss_tiny, monkeypatch):
    out = tmp_path / "out"
    convert(src, out, ep_size=2)
    text = (out / MANIFEST_NAME).read_text()
    assert str(tmp_path) not in text
    assert read_manifest(out)["source"]["name"] == "src"
    assert validate(out).passed  # the local source is still found for this machine's validate
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub_cache(tmp_path / "hub", "org/tiny", gpt_oss_tiny)
    convert("org/tiny", tmp_path / "hubout", cache_dir=tmp_path / "hub")
    text = (tmp_path / "hubout" / MANIFEST_NAME).read_text()
    assert str(tmp_path) not in text and os.path.expanduser("~") + "/" not in text
    s = read_manifest(tmp_path / "hubout")["source"]
    assert s["repo_id"] == "org/tiny" and len(s["commit"]) == 40


# -- 3. a manifest is input too ---------------------------------------------------------------------
def _edit_manifest(out: Path, fn) -> None:
    m = json.loads((out / MANIFEST_NAME).read_text())
    fn(m)
    (out / MANIFEST_NAME).write_text(json.dumps(m))


@pytest.mark.parametrize("edit,where", [
    (lambda m: m["copied"].append({"path": "../../secret.txt", "bytes": 5, "sha256": "0" * 64}), "copied"),
    (lambda m: m["ranks"][0]["files"][0].update(path="/etc/passwd"), "ranks"),
    (lambda m: m["ranks"][1].update(folder="../src"), "folder"),
    (lambda m: m["common"].update(folder="/etc"), "common"),
    (lambda m: m["ranks"][0]["files"][0].update(path="rank-00000/../../x.safetensors"), "ranks"),
])
def test_manifest_paths_outside_the_artifact_are_refused(tmp_path, src, monkeypatch, capsys, edit, where):
    out = tmp_path / "a" / "out"
    convert(src, out, ep_size=2)
    (tmp_path / "secret.txt").write_text("hello")
    _edit_manifest(out, edit)
    for cmd in (lambda: verify(out), lambda: moeshard.load_rank(out, 0, device="cpu"), lambda: validate(out)):
        with pytest.raises(MoeshardError, match="moeshard.json: .*outside the artifact|not a relative path"):
            cmd()
    code, err = one_line(monkeypatch, capsys, "verify", out)
    assert code == 1 and "OK" not in err


def test_manifest_file_symlinked_outside_is_refused(tmp_path, src):
    out = tmp_path / "out"
    convert(src, out, ep_size=2)
    f = out / "rank-00000" / "model.safetensors"
    twin = tmp_path / "twin.safetensors"
    shutil.copy(f, twin)
    f.unlink()
    os.symlink(twin, f)
    with pytest.raises(MoeshardError, match="outside the artifact"):
        moeshard.load_rank(out, 0, device="cpu")
    assert not verify(out)[0].ok or any("outside" in c.problem for c in verify(out))


@pytest.mark.parametrize("header", [b"\xff\xff\xff\xff\xff\xff\x00\x00", (40).to_bytes(8, "little") + b"\xff\xfe" * 20])
def test_bad_rank_file_header_is_a_clean_error(tmp_path, src, header):
    out = tmp_path / "out"
    convert(src, out, ep_size=2)
    f = out / "rank-00000" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(header + data[len(header):])
    with pytest.raises(MoeshardError, match=r"rank-00000/model\.safetensors: "):
        moeshard.load_rank(out, 0, device="cpu")
    with pytest.raises(MoeshardError, match=r"rank-00000"):
        validate(out)


# -- 4. inputs that blow up -------------------------------------------------------------------------
def _limited(*args, seconds=60):
    """The CLI in a subprocess with 3 GB of address space at most: absurd inputs must fail fast."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from moeshard.cli import main; sys.argv = ['moeshard'] + sys.argv[1:]; main()")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=seconds)


@pytest.mark.parametrize("family,key", [("gpt_oss_tiny", "num_hidden_layers"), ("deepseek_tiny", "num_hidden_layers"),
                                        ("deepseek_tiny", "n_routed_experts")])
def test_absurd_config_values_fail_fast(request, tmp_path, family, key):
    s = tmp_path / "s"
    shutil.copytree(request.getfixturevalue(family), s)
    cfg = json.loads((s / "config.json").read_text())
    cfg[key] = 10**9
    (s / "config.json").write_text(json.dumps(cfg))
    r = _limited("convert", s, "-o", tmp_path / "o", "-q")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert key in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _limited("inspect", s)
    assert r.returncode == 1 and key in r.stderr


def test_huge_tp_size_is_refused_at_once(tmp_path, src):
    r = _limited("convert", src, "-o", tmp_path / "o", "--tp-size", "100000", "--dry-run", seconds=30)
    assert r.returncode == 1 and "largest valid --tp-size" in r.stderr, r.stderr[-2000:]


# -- 5. tracebacks and leftovers --------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cuda", "tpu"])
def test_unusable_device_is_refused_before_anything(tmp_path, src, monkeypatch, capsys, device):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, err = one_line(monkeypatch, capsys, "convert", src, "-o", tmp_path / "o", "--device", device, "-q")
    assert code == 1 and "--device" in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("tokens", ["0", "-1"])
def test_validate_tokens_are_range_checked(tmp_path, src, tokens):
    r = run_cli("validate", tmp_path, "--tokens", tokens)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--tokens" in r.stderr


def test_push_without_network_is_one_line(tmp_path, src):
    out = tmp_path / "out"
    convert(src, out)
    r = run_cli("push", out, "me/x", env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_x",
                                             "HF_HUB_DISABLE_XET": "1", "HF_HUB_ETAG_TIMEOUT": "2"})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "me/x" in r.stderr


def test_refused_resume_leaves_no_lock(tmp_path, src, monkeypatch, capsys):
    out = tmp_path / "out"
    convert(src, out)
    code, err = one_line(monkeypatch, capsys, "convert", src, "-o", out, "--resume")
    assert code == 1 and "nothing to resume" in err
    assert not (out / LOCK_NAME).exists()
    fresh = tmp_path / "fresh"
    with pytest.raises(MoeshardError):
        convert(src, fresh, ep_size=3)
    assert not fresh.exists()


def test_ctrl_c_says_what_was_kept(tmp_path, src):
    out = tmp_path / "out"
    r = run_cli("convert", src, "-o", out, "--ep-size", "2", "-q", env={FAULT_ENV: "2:INT"})
    assert r.returncode == 130 and "Traceback" not in r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "--resume" in line and "2 finished files" in line, line
    assert (out / STATE_DIR).is_dir() and not (out / LOCK_NAME).exists()


# -- 6. messages -------------------------------------------------------------------------------------
def test_missing_path_says_so(tmp_path, monkeypatch, capsys):
    code, err = one_line(monkeypatch, capsys, "validate", tmp_path / "nope")
    assert code == 1 and "does not exist" in err
    code, err = one_line(monkeypatch, capsys, "verify", tmp_path / "nope")
    assert code == 1 and "does not exist" in err


def test_typo_path_says_neither_folder_nor_repo(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    code, err = one_line(monkeypatch, capsys, "convert", "models/gpt-oss-20b", "-o", "o")
    assert code == 1 and "no folder models/gpt-oss-20b here" in err and "Hub cache" in err


def test_converting_an_artifact_says_it_is_one(tmp_path, src, monkeypatch, capsys):
    out = tmp_path / "out"
    convert(src, out)
    code, err = one_line(monkeypatch, capsys, "convert", out, "-o", tmp_path / "o2")
    assert code == 1 and "is a moeshard artifact" in err


def test_help_documents_debug_and_hides_bool_metavars():
    r = run_cli("--help")
    assert "MOESHARD_DEBUG" in r.stdout and "<bool>" not in r.stdout
    assert "<bool>" not in run_cli("push", "--help").stdout
    r = run_cli("--version")
    assert r.returncode == 0 and moeshard.__version__ in r.stdout


def test_resume_reports_written_and_reused_bytes(tmp_path, src):
    out = tmp_path / "out"
    r = run_cli("convert", src, "-o", out, "--ep-size", "2", "-q", env={FAULT_ENV: "2:KILL"})
    assert r.returncode == -9
    r = run_cli("convert", src, "-o", out, "--ep-size", "2", "--resume", "--json")
    s = json.loads(r.stdout)
    assert s["bytes_reused"] > 0 and s["bytes_written"] > 0 and s["files_reused"] == 2
    r = run_cli("convert", src, "-o", tmp_path / "one", "--ep-size", "1")
    assert "1 rank:" in r.stderr and "0.00 GB/s" not in r.stderr and "1 ranks" not in r.stderr


def test_inspect_fits_80_columns_and_json_lists_experts(tmp_path, src):
    out = tmp_path / "out"
    convert(src, out, ep_size=2, tp_size=2)
    r = run_cli("inspect", out, env={"COLUMNS": "80"})
    assert r.returncode == 0 and "None" not in r.stdout
    assert all(len(line) <= 80 for line in r.stdout.splitlines())
    assert "per rank" in r.stdout
    info = json.loads(run_cli("inspect", out, "--json").stdout)
    assert info["ranks"][0]["experts"] == [0, 1, 2, 3]
    r = run_cli("inspect", src, env={"COLUMNS": "80"})
    assert r.returncode == 0 and "None" not in r.stdout and all(len(x) <= 80 for x in r.stdout.splitlines())


def test_verify_inspect_push_do_not_import_torch(tmp_path, src):
    out = tmp_path / "out"
    convert(src, out)
    for args in (["verify", str(out)], ["inspect", str(out), "--json"]):
        code = ("import sys; from moeshard.cli import app; from typer.testing import CliRunner; "
                f"r = CliRunner().invoke(app, {args!r}); assert r.exit_code == 0, r.output; "
                "assert 'torch' not in sys.modules, 'torch imported'")
        subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
    code = "import sys; import moeshard.artifact.push; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_validate_progress_counts_ranks_and_layers(tmp_path, src):
    out = tmp_path / "out"
    convert(src, out, ep_size=2)
    seen = {"total": None, "done": 0}

    def tick(n=0, what=""):
        seen["done"] += n

    tick.total = lambda n: seen.update(total=n)
    validate(out, progress=tick)
    assert seen["total"] and seen["done"] == seen["total"]
