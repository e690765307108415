"""Shared fixtures: tiny checkpoints with the real names, built once per session in tmp dirs."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from moeshard.convert.pipeline import convert
from moeshard.fixtures import fixture


@pytest.fixture(scope="session")
def gpt_oss_tiny(tmp_path_factory) -> Path:
    """openai/gpt-oss layout, 2 layers, 8 experts, H=160, I=96 (padding to 256 exercised)."""
    return fixture("gpt-oss", "tiny", tmp_path_factory.mktemp("gpt-oss-tiny") / "ckpt")


@pytest.fixture(scope="session")
def deepseek_tiny(tmp_path_factory) -> Path:
    """nvidia/DeepSeek-R1-FP4 layout, 3 layers (1 dense), 16 experts in 4 groups, H=192, I=96."""
    return fixture("deepseek-r1-fp4", "tiny", tmp_path_factory.mktemp("deepseek-tiny") / "ckpt")


@pytest.fixture(scope="session")
def llama4_tiny(tmp_path_factory) -> Path:
    """nvidia/Llama-4-Scout-17B-16E-Instruct-FP4 layout, 2 MoE layers, 8 fused experts, H=192, I=96."""
    return fixture("llama4-scout-fp4", "tiny", tmp_path_factory.mktemp("llama4-tiny") / "ckpt")


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory, request):
    """Converted artifacts of a tiny fixture, by (fixture name, ep_size, pad_multiple, hidden_padding),
    made on demand."""
    made: dict[tuple, Path] = {}

    def get(source: str, ep_size: int, pad_multiple: int = 256, hidden_padding: str = "vllm") -> Path:
        key = (source, ep_size, pad_multiple, hidden_padding)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{source}-ep{ep_size}-pad{pad_multiple}-{hidden_padding}") / "out"
            convert(request.getfixturevalue(source), out, ep_size=ep_size, pad_multiple=pad_multiple,
                    hidden_padding=hidden_padding)
            made[key] = out
        return made[key]

    return get


@pytest.fixture(scope="session")
def gpt_oss_artifacts(artifacts, gpt_oss_tiny):
    return lambda ep_size, pad_multiple=256: artifacts("gpt_oss_tiny", ep_size, pad_multiple)


class ReachedLauncher(Exception):
    """Raised by the stand-in of FlashInfer's compiled MoE op: the Python side let the call through."""


@pytest.fixture
def flashinfer_launcher(monkeypatch):
    """FlashInfer's own Python side of the trtllm-gen FP4 MoE (``trtllm_fp4_block_scale_moe``, the
    unified ``TrtllmFp4RoutedRunner``), run for real on the CPU up to its compiled launcher: the
    module build (``core.gen_trtllm_gen_fused_moe_sm100_module``, CUDA-only) is replaced by one whose
    op records the launcher's arguments and stops. ``run(fn, *args, **kwargs)`` calls ``fn`` and
    returns ``(launcher arguments by the names of the installed launcher's signature, warnings)``."""
    import flashinfer
    from flashinfer.fused_moe import core

    # the FP4 entry's parameters, from the installed launcher (trtllm_fused_moe_kernel_launcher.cu:6001-6014)
    src = (Path(flashinfer.__file__).parent / "data/csrc/trtllm_fused_moe_kernel_launcher.cu").read_text()
    entry = src[src.index("Array<Tensor> trtllm_fp4_block_scale_moe("):]
    names, calls = [p.split()[-1] for p in entry[entry.index("(") + 1:entry.index(") {")].split(",")], []

    class Op:
        def trtllm_fp4_block_scale_moe(self, *args):
            calls.append(dict(zip(names, args, strict=True)))
            raise ReachedLauncher

        def __getattr__(self, name):  # the module looks its ops up when built; none other may run
            def unexpected(*args, **kwargs):
                raise AssertionError(f"unexpected call of the compiled op {name}")

            return unexpected

    class Module:
        def build_and_load(self):
            return Op()

        def get_library_paths(self):
            return []

    monkeypatch.setattr(core, "gen_trtllm_gen_fused_moe_sm100_module", lambda enable_rubin=False: Module())
    monkeypatch.setattr(core, "setup_cubin_loader", lambda path: None)
    monkeypatch.setattr(core, "get_trtllm_moe_sm100_module", lambda: core._get_trtllm_moe_sm100_module_impl(False))
    core._get_trtllm_moe_sm100_module_impl.cache_clear()

    def run(fn, *args, **kwargs):
        calls.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ReachedLauncher):
                fn(*args, **kwargs)
        (launched,) = calls
        return launched, list(caught)

    yield run
    core._get_trtllm_moe_sm100_module_impl.cache_clear()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run tests/gpu on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
