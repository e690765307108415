"""Shared fixtures: tiny checkpoints with the real names, built once per session in tmp dirs."""

from __future__ import annotations

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
    """Converted artifacts of a tiny fixture, by (fixture name, ep_size, pad_multiple), made on demand."""
    made: dict[tuple, Path] = {}

    def get(source: str, ep_size: int, pad_multiple: int = 256) -> Path:
        key = (source, ep_size, pad_multiple)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{source}-ep{ep_size}-pad{pad_multiple}") / "out"
            convert(request.getfixturevalue(source), out, ep_size=ep_size, pad_multiple=pad_multiple)
            made[key] = out
        return made[key]

    return get


@pytest.fixture(scope="session")
def gpt_oss_artifacts(artifacts, gpt_oss_tiny):
    return lambda ep_size, pad_multiple=256: artifacts("gpt_oss_tiny", ep_size, pad_multiple)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run tests/gpu on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
