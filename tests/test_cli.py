"""The CLI end to end on the tiny fixture: fixture, convert, inspect, validate, demo, errors."""

import json

import pytest
from typer.testing import CliRunner

from moeshard.cli import app, main

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_fixture_convert_inspect_validate(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    r = run("fixture", "gpt-oss", "--preset", "tiny", "-o", src)
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in src.iterdir())
    assert names == ["config.json", "generation_config.json", "model-00000-of-00002.safetensors",
                     "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"]
    r = run("convert", src, "-o", out, "--ep-size", "4", "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["ranks"] == 4 and summary["bytes_written"] > 0
    info = json.loads(run("inspect", out, "--json").stdout)
    assert info["kind"] == "artifact" and info["ep_size"] == 4 and len(info["ranks"]) == 4
    assert info["kernel_args"]["intermediate_size"] == 256 and info["kernel_args"]["top_k"] == 2
    info = json.loads(run("inspect", src, "--json").stdout)
    assert info["kind"] == "checkpoint" and info["family"] == "gpt-oss" and info["num_experts"] == 8
    r = run("validate", out, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["passed"] and len(report["rows"]) == 2 * (4 + 1)
    r = run("validate", out, "--ranks", "1-2", "--layers", "1")
    assert r.exit_code == 0 and "PASS" in r.stdout
    assert "model.layers.1" not in r.stdout  # a table, not a dump
    r = run("convert", src, "-o", out, "--ep-size", "2")
    assert r.exit_code != 0  # existing artifact is not overwritten without --overwrite
    r = run("convert", src, "-o", out, "--ep-size", "2", "--overwrite", "-q")
    assert r.exit_code == 0, r.output
    r = run("convert", src, "-o", tmp_path / "dry", "--ep-size", "2", "--dry-run", "--json")
    assert r.exit_code == 0 and not (tmp_path / "dry").exists()
    assert len(json.loads(r.stdout)["ranks"]) == 2


def _main_error(monkeypatch, capsys, *args):
    monkeypatch.setattr("sys.argv", ["moeshard", *map(str, args)])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    return e.value.code, err


def test_uneven_split_is_one_line_error(tmp_path, monkeypatch, capsys, gpt_oss_tiny):
    code, err = _main_error(monkeypatch, capsys, "convert", gpt_oss_tiny, "-o", tmp_path / "o", "--ep-size", "3")
    assert code == 1
    first = err.splitlines()[0]
    assert "8 experts cannot be split evenly over --ep-size 3" in first and "valid sizes: 1, 2, 4, 8" in first
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_not_an_artifact(tmp_path, monkeypatch, capsys):
    (tmp_path / "half").mkdir()
    code, err = _main_error(monkeypatch, capsys, "validate", tmp_path / "half")
    assert code == 1 and "not a moeshard artifact: moeshard.json is missing" in err


def test_wrong_dtype_names_file_tensor_expected_found(tmp_path, monkeypatch, capsys, gpt_oss_tiny):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "bad"
    shutil.copytree(gpt_oss_tiny, src)
    f = src / "model-00001-of-00002.safetensors"
    t = load_file(f)
    t["model.layers.0.mlp.experts.gate_up_proj_scales"] = t["model.layers.0.mlp.experts.gate_up_proj_scales"].to(torch.bfloat16)
    save_file(t, f)
    code, err = _main_error(monkeypatch, capsys, "convert", src, "-o", tmp_path / "o")
    assert code == 1
    assert ("model-00001-of-00002.safetensors: model.layers.0.mlp.experts.gate_up_proj_scales: "
            "expected dtype U8, found BF16") in err


@pytest.mark.parametrize("family,quant", [("gpt-oss", "mxfp4"), ("deepseek-r1-fp4", "nvfp4"),
                                          ("llama4-scout-fp4", "nvfp4")])
def test_demo(tmp_path, family, quant):
    r = run("demo", "-o", tmp_path / "demo", "--family", family, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["validate"]["passed"] and doc["inspect"]["ep_size"] == 2 and doc["inspect"]["quant_format"] == quant


def test_help_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys; from moeshard.cli import app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
