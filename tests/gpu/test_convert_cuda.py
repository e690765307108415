"""On a CUDA GPU: ``convert --device cuda`` (gathers on the GPU) writes the same bytes as the CPU."""

from __future__ import annotations

import pytest

from moeshard.convert.pipeline import convert

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["gpt_oss_tiny", "deepseek_tiny", "llama4_tiny"])
@pytest.mark.parametrize("layout", [{"ep_size": 2}, {"ep_size": 2, "tp_size": 2}, {"ep_size": 2, "placement": "round-robin"}])
def test_cuda_convert_equals_cpu_convert(request, tmp_path, family, layout):
    src = request.getfixturevalue(family)
    convert(src, tmp_path / "cpu", **layout)
    convert(src, tmp_path / "cuda", device="cuda", **layout)
    files = sorted(p.relative_to(tmp_path / "cpu") for p in (tmp_path / "cpu").rglob("*.safetensors"))
    assert files and all((tmp_path / "cpu" / f).read_bytes() == (tmp_path / "cuda" / f).read_bytes() for f in files)
