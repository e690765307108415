"""The dtype table and the safetensors writer, against the installed safetensors."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeshard.checkpoints.safetensors_io import DTYPES, pack_groups, read_header, shard_names, write_safetensors
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


@pytest.mark.parametrize("direct", [True, False])
def test_sequential_writer_in_file_order_with_its_hash(tmp_path, monkeypatch, direct):
    """Tensors come in file order, in pieces that straddle staging buffers at unaligned offsets;
    the file reads back with safetensors and the returned hash is the file's."""
    import hashlib

    from moeshard.artifact import writer as wmod

    monkeypatch.setattr(wmod, "BUFFER_BYTES", 3 * wmod.ALIGN)  # many flushes, tails carried over
    for seed in range(2):  # the second file reuses the first one's staging buffers
        torch.manual_seed(seed)
        a = torch.randint(0, 256, (40, 1000), dtype=torch.uint8)
        b = torch.randn(3, 2).to(torch.float8_e4m3fn)
        f = tmp_path / f"s{seed}.safetensors"
        w = wmod.SequentialWriter(f, [("a", "U8", (40, 1000)), ("b", "F8_E4M3", (3, 2)), ("s", "F32", ())],
                                  max_take=7000, direct=direct)
        assert w.order == ["s", "a", "b"]  # wider dtypes first, as safetensors lays them out
        with pytest.raises(ValueError, match="not the next ones"):
            w.take("a", 10)  # "s" comes first
        w.put("s", torch.tensor(2.5))
        for k in range(0, 40, 7):
            w.take("a", a[k:k + 7].numel()).copy_(a[k:k + 7].reshape(-1))
        with pytest.raises(ValueError, match="not the next ones"):
            w.take("b", 7)  # 6 bytes only
        w.put("b", b)
        sha = w.close().result()
        assert sha == hashlib.sha256(f.read_bytes()).hexdigest()
        with safe_open(f, "pt") as g:
            assert torch.equal(g.get_tensor("a"), a) and g.get_tensor("s").item() == 2.5
            assert torch.equal(g.get_tensor("b").view(torch.uint8), b.view(torch.uint8))
            assert g.metadata() == {"format": "pt"}


@pytest.mark.parametrize("refuses", ["open", "write"])
def test_sequential_writer_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch, refuses):
    """A file system that refuses O_DIRECT at open, or only at the first write (EINVAL), still
    gets the exact file, through the page cache."""
    import errno
    import hashlib
    import os

    from moeshard.artifact import writer as wmod

    real_open, real_pwrite = os.open, os.pwrite
    state = {"direct_fds": set()}

    def fake_open(path, flags, *a):
        if flags & os.O_DIRECT and refuses == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *a)
        (state["direct_fds"].add if flags & os.O_DIRECT else state["direct_fds"].discard)(fd)
        return fd

    def fake_pwrite(fd, data, offset):
        if fd in state["direct_fds"]:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(wmod.os, "open", fake_open)
    monkeypatch.setattr(wmod.os, "pwrite", fake_pwrite)
    a = torch.randint(0, 256, (5, 3001), dtype=torch.uint8)
    f = tmp_path / "s.safetensors"
    w = wmod.SequentialWriter(f, [("a", "U8", (5, 3001))])
    w.put("a", a)
    sha = w.close().result()
    assert not w.direct and sha == hashlib.sha256(f.read_bytes()).hexdigest()
    with safe_open(f, "pt") as g:
        assert torch.equal(g.get_tensor("a"), a)


def test_sequential_writer_refuses_an_incomplete_file(tmp_path):
    from moeshard.artifact.writer import SequentialWriter

    w = SequentialWriter(tmp_path / "s.safetensors", [("a", "U8", (4, 6))])
    w.take("a", 12).zero_()
    with pytest.raises(ValueError, match=r"108 of 120 bytes"):
        w.close()


