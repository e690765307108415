"""``moeshard.load_rank``: one rank of an artifact, on the GPU, ready for FlashInfer's kernel.

Each of the rank's files is read once, in 32 MB chunks, by four threads into their own pinned
host buffers, each copied to one device buffer per file while the next chunk is read; tensors
are views into that buffer (the writer aligns every tensor to its element size).
Nothing is parsed or transformed per tensor: the bytes are already in kernel layout.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moeshard.artifact.manifest import MANIFEST_NAME, Manifest, artifact_file
from moeshard.checkpoints.safetensors_io import DTYPES, header_length, pread_into
from moeshard.errors import MoeshardError
from moeshard.layouts.fingerprint import layout_fingerprint
from moeshard.layouts.kernel import static_kernel_args
from moeshard.layouts.trtllm import LAYOUT_NAME, LAYOUT_VERSION, flashinfer_version

CHUNK = 32 << 20
READERS = 4


@dataclass
class MoeLayer:
    """One MoE layer of one rank.

    ``tensors`` maps FlashInfer parameter names (``gemm1_weights`` ... ``output2_scale_scalar``,
    and ``hidden_states_scale_global`` for NVFP4) to tensors on the device; ``args`` holds the
    scalar arguments (``num_experts``, ``top_k``, ``n_group``, ``topk_group``,
    ``intermediate_size``, ``local_expert_offset``, ``local_num_experts``,
    ``routed_scaling_factor``, ``routing_method_type``, ``activation_type``); ``router`` names the
    router tensors in ``common/`` (``weight``; ``correction_bias`` = the kernel's
    ``routing_bias`` for DeepSeek; ``bias`` = GPT-OSS's router bias, added to the logits).
    """

    layer: int
    prefix: str
    tensors: dict[str, torch.Tensor]
    args: dict
    router: dict[str, str]
    hidden_size: int  # pad hidden states to this (zeros); valid_hidden_size columns are real
    valid_hidden_size: int

    def kernel_kwargs(self, routing_logits: torch.Tensor, hidden_states: torch.Tensor,
                      hidden_states_scale: torch.Tensor | None = None, routing_bias: torch.Tensor | None = None
                      ) -> dict:
        """All keyword arguments of ``flashinfer.fused_moe.trtllm_fp4_block_scale_moe``."""
        kw = static_kernel_args(self.tensors, self.args, self.args)
        kw.update(routing_logits=routing_logits, routing_bias=routing_bias, hidden_states=hidden_states,
                  hidden_states_scale=hidden_states_scale)
        return kw


@dataclass
class RankWeights:
    """What :func:`load_rank` returns: the rank's MoE layers and where everything else is."""

    artifact: Path
    rank: int
    ep_rank: int
    tp_rank: int
    experts: list[int]
    layers: dict[int, MoeLayer]
    common_folder: Path | None  # every non-expert tensor, unchanged (None: a rank-only artifact without it)
    manifest: Manifest = field(repr=False)
    bytes_read: int = 0


_PINNED: list[torch.Tensor] = []  # staging buffers, allocated once per process (cudaHostAlloc is slow)


def _staging(n: int, chunk: int) -> list[torch.Tensor]:
    while len(_PINNED) < n or _PINNED[0].numel() < chunk:
        if _PINNED and _PINNED[0].numel() < chunk:
            _PINNED.clear()
        _PINNED.append(torch.empty(chunk, dtype=torch.uint8).pin_memory())
    return _PINNED[:n]


def read_file_to(path: Path, device: str | torch.device, chunk: int = CHUNK, workers: int | None = None
                 ) -> tuple[dict, torch.Tensor]:
    """Header and data buffer (uint8, on ``device``) of one safetensors file.

    On CUDA, ``workers`` threads each read chunks (``preadv``, no GIL held) into their own
    pinned buffer and copy it to the device on their own stream, so that reads run in parallel
    with each other and with the copies.
    """
    path = Path(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        total = os.fstat(fd).st_size
        n = header_length(path, os.pread(fd, 8, 0), total)
        try:
            header = json.loads(os.pread(fd, n, 8))
            if not isinstance(header, dict):
                raise ValueError(f"expected a JSON object, found {type(header).__name__}")
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise MoeshardError(f"{path}: unreadable safetensors header: {e}") from None
        start, size = 8 + n, total - 8 - n
        device = torch.device(device)
        if device.type != "cuda":
            buf = torch.empty(size, dtype=torch.uint8)
            pread_into(fd, memoryview(buf.numpy()), start, str(path))
            return header, buf
        out = torch.empty(size, dtype=torch.uint8, device=device)
        workers = workers or READERS
        offsets = list(range(0, size, chunk))
        bufs = _staging(workers, chunk)

        def work(w: int) -> None:
            stream = torch.cuda.Stream(device)
            done = torch.cuda.Event()
            view = memoryview(bufs[w].numpy())
            for off in offsets[w::workers]:
                m = min(chunk, size - off)
                done.synchronize()  # this buffer's previous copy has finished
                pread_into(fd, view[:m], start + off, str(path))
                with torch.cuda.stream(stream):
                    out[off:off + m].copy_(bufs[w][:m], non_blocking=True)
                    done.record(stream)
            stream.synchronize()

        with ThreadPoolExecutor(max_workers=workers) as ex:
            list(ex.map(work, range(workers)))
        return header, out
    finally:
        os.close(fd)


def _views(header: dict, buf: torch.Tensor, path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one file as views of ``buf``; a MoeshardError for a header that does not fit."""
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        try:
            a, b = h["data_offsets"]
            dtype = DTYPES[h["dtype"]]
            if not 0 <= a <= b <= buf.numel():
                raise ValueError(f"data_offsets {a}..{b} outside the {buf.numel()} data bytes")
            t = buf[a:b]
            t = t.view(dtype) if a % dtype.itemsize == 0 else t.clone().view(dtype)  # files of other writers
            out[name] = t.view(h["shape"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise MoeshardError(f"{path}: {name}: unreadable safetensors header entry ({type(e).__name__}: {e})") from None
    return out


def check_layout(m: Manifest, where: Path | str, check_flashinfer: bool = True) -> None:
    """Refuse an artifact this moeshard and the installed FlashInfer would lay out otherwise.

    The layout name and version must be this moeshard's. With ``check_flashinfer``, the layout
    fingerprint is recomputed from the installed FlashInfer for the artifact's shapes
    (:func:`layout_fingerprint`) and must equal the recorded one kind by kind, whatever
    FlashInfer version made it; a version 1 artifact, which records none, must come from the
    installed FlashInfer version.
    """
    if (m.layout.name, m.layout.version) != (LAYOUT_NAME, LAYOUT_VERSION):
        raise MoeshardError(f"{where}: layout: expected {LAYOUT_NAME} version {LAYOUT_VERSION}, found "
                            f"{m.layout.name} version {m.layout.version}; convert the checkpoint again with this "
                            "moeshard")
    if not check_flashinfer:
        return
    made_for, installed, recorded = m.tool.flashinfer, flashinfer_version(), m.layout.fingerprint
    if not recorded:
        if made_for and installed and made_for != installed:
            raise MoeshardError(f"{where}: made for flashinfer-python {made_for}, found {installed} installed, and "
                                "it records no layout fingerprint (schema version 1): convert again, or pass "
                                "check_flashinfer=False if you know the layout is unchanged")
        return
    p = m.padding
    now = layout_fingerprint(recorded, p.hidden_size_padded, p.gemm2_rows, p.intermediate_size_padded,
                             m.layout.sf_vec_size, m.layout.epilogue_tile_m)
    changed = [kind for kind, digest in recorded.items() if now.get(kind) != digest]
    if changed:
        raise MoeshardError(f"{where}: layout.fingerprint: the installed flashinfer-python {installed} lays out "
                            f"{', '.join(changed)} otherwise than flashinfer-python {made_for}, which made this "
                            "artifact: convert it again with the installed FlashInfer")


def load_rank(artifact: Path | str, rank: int, device: str | torch.device = "cuda", *,
              check_flashinfer: bool = True) -> RankWeights:
    """Load rank ``rank`` of a moeshard artifact onto ``device``, reading only that rank's files.

    Checks the layout (:func:`check_layout`; ``check_flashinfer=False`` skips the FlashInfer
    part). Returns the rank's MoE layers with their kernel tensors and arguments; see
    :meth:`MoeLayer.kernel_kwargs`.
    """
    artifact = Path(artifact)
    m = Manifest.read(artifact)
    check_layout(m, artifact / MANIFEST_NAME, check_flashinfer)
    info = m.rank(rank)
    tensors: dict[str, torch.Tensor] = {}
    nbytes = 0
    for f in info.files:
        path = artifact_file(artifact, f.path)
        if not path.is_file() or path.stat().st_size != f.bytes:
            raise MoeshardError(f"{path}: missing or of the wrong size (expected {f.bytes} bytes); "
                                "moeshard verify checks the artifact")
        header, buf = read_file_to(path, device)
        tensors.update(_views(header, buf, path))
        nbytes += f.bytes
    layers = {}
    for entry in m.moe_layers:
        p = entry.prefix
        lt = {k[len(p) + 1:]: v for k, v in tensors.items() if k.startswith(p + ".")}
        args = {**entry.kernel_args, "local_expert_offset": info.local_expert_offset,
                "local_num_experts": info.local_num_experts}
        layers[entry.layer] = MoeLayer(entry.layer, p, lt, args, {k: v.format(layer=entry.layer)
                                                                  for k, v in m.router.items()},
                                       m.padding.hidden_size_padded, m.padding.hidden_size)
    return RankWeights(artifact, rank, info.ep_rank, info.tp_rank, list(info.experts), layers,
                       artifact_file(artifact, m.common.folder) if m.common else None, m, nbytes)
