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
def gpt_oss_artifacts(tmp_path_factory, gpt_oss_tiny):
    """Converted artifacts of the tiny GPT-OSS fixture, by (ep_size, pad_multiple), made on demand."""
    made: dict[tuple[int, int], Path] = {}

    def get(ep_size: int, pad_multiple: int = 256) -> Path:
        key = (ep_size, pad_multiple)
        if key not in made:
            out = tmp_path_factory.mktemp(f"art-ep{ep_size}-pad{pad_multiple}") / "out"
            convert(gpt_oss_tiny, out, ep_size=ep_size, pad_multiple=pad_multiple)
            made[key] = out
        return made[key]

    return get


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run tests/gpu on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
