"""The dtype table and the safetensors writer, against the installed safetensors."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeshard.convert.io import DTYPES, pack_groups, read_header, shard_names, write_safetensors
from moeshard.errors import MoeshardError


@pytest.mark.parametrize("code,dtype", sorted(DTYPES.items()))
def test_dtype_table_matches_safetensors(tmp_path, code, dtype):
    shape = (2, 4)
    t = torch.zeros(shape, dtype=dtype)
    save_file({"t": t}, tmp_path / "a.safetensors")
    assert read_header(tmp_path / "a.safetensors")["t"].dtype == code
    with safe_open(tmp_path / "a.safetensors", "pt") as f:
        assert f.get_tensor("t").dtype == dtype


def test_writer_is_readable_and_atomic(tmp_path):
    t = {"b": torch.arange(6, dtype=torch.float32), "a": torch.ones(2, 3, dtype=torch.uint8)}
    write_safetensors(tmp_path / "x.safetensors", t)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("b"), t["b"]) and f.metadata() == {"format": "pt"}


def test_truncated_header_is_a_user_error(tmp_path):
    save_file({"t": torch.zeros(4)}, tmp_path / "a.safetensors")
    data = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "a.safetensors").write_bytes(data[:20])
    with pytest.raises(MoeshardError, match="a.safetensors: truncated safetensors header"):
        read_header(tmp_path / "a.safetensors")


def test_shard_names_and_packing():
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert shard_names(3, zero_based=True)[-1] == "model-00002-of-00002.safetensors"
    assert pack_groups([5, 5, 5], 10) == [[0, 1], [2]]
    assert pack_groups([20, 1, 1], 10) == [[0], [1, 2]]
    assert json.dumps(pack_groups([], 10)) == "[[]]"


def test_streaming_writer_fills_tensors_in_any_order(tmp_path):
    from moeshard.convert.writer import StreamingWriter

    a = torch.arange(24, dtype=torch.uint8).view(4, 6)
    b = torch.randn(3, 2).to(torch.float8_e4m3fn)
    w = StreamingWriter(tmp_path / "s.safetensors", [("a", "U8", (4, 6)), ("b", "F8_E4M3", (3, 2)),
                                                     ("s", "F32", ())])
    w.write("s", torch.tensor(2.5))
    w.write("a", a[2:], 2)
    w.write("b", b)
    w.write("a", a[:2], 0)
    with pytest.raises(ValueError, match="overflow"):
        w.write("a", a, 1)
    w.close()
    with safe_open(tmp_path / "s.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("a"), a) and f.get_tensor("s").item() == 2.5
        assert torch.equal(f.get_tensor("b").view(torch.uint8), b.view(torch.uint8))
        assert f.metadata() == {"format": "pt"}
