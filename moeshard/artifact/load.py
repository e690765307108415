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
from moeshard.layouts.kernel import TENSOR_ARGS, static_kernel_args
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
    ``routed_scaling_factor``, ``routing_method_type``, ``activation_type``, ``norm_topk_prob``
    where the checkpoint says, and ``valid_hidden_size`` in the "trimmed" hidden padding);
    ``router`` names the router tensors in ``common/`` (``weight``; ``correction_bias`` = the
    kernel's ``routing_bias`` for DeepSeek; ``bias`` = GPT-OSS's router bias, added to the logits).
    ``hidden_size`` is the padded width of the hidden states, ``valid_hidden_size`` the model's.
    """

    layer: int
    prefix: str
    tensors: dict[str, torch.Tensor]
    args: dict
    router: dict[str, str]
    hidden_size: int  # pad hidden states to this (zeros); valid_hidden_size columns are real
    valid_hidden_size: int

    @property
    def output_width(self) -> int:
        """Columns of the kernel's output ``[T, output_width]`` bf16: ``valid_hidden_size`` in the
        "trimmed" hidden padding (the kernel writes no more), else ``hidden_size`` (keep the first
        ``valid_hidden_size``)."""
        return self.args.get("valid_hidden_size") or self.hidden_size

    def kernel_kwargs(self, routing_logits: torch.Tensor, hidden_states: torch.Tensor,
                      hidden_states_scale: torch.Tensor | None = None, routing_bias: torch.Tensor | None = None
                      ) -> dict:
        """Every keyword argument of ``flashinfer.fused_moe.trtllm_fp4_block_scale_moe``
        (FlashInfer 0.7.2.post1) for this layer, none left to a default that warns.

        Parameters
        ----------
        routing_logits : ``[T, num_experts]`` float32 or bfloat16
        hidden_states : the activations zero-padded to ``hidden_size`` columns, in a form the
            weights take (same weights, different arguments):

            - MXFP4 weights (GPT-OSS), BF16: bfloat16 ``[T, hidden_size]``, no scale;
            - MXFP4 weights, MXFP8 (vLLM's and SGLang's default on Blackwell): float8_e4m3fn
              ``[T, hidden_size]`` with ``hidden_states_scale`` its UE8M0 block scales as
              float8_e4m3fn ``[T, hidden_size // 32]`` (or flat), linear:
              ``mxfp8_quantize(x, False, alignment=hidden_size)``;
            - NVFP4 weights: uint8 ``[T, hidden_size // 2]`` with float8_e4m3fn
              ``[T, hidden_size // 16]`` linear scales, quantized with
              ``tensors["hidden_states_scale_global"]``.
        routing_bias : DeepSeekV3's ``e_score_correction_bias`` ``[num_experts]`` (``router
            ["correction_bias"]`` in ``common/``): required there, refused for other routings.

        ``hidden_states_scale_layout`` is declared linear; ``valid_hidden_size`` is passed in the
        "trimmed" hidden padding only. The kernel returns ``[output]``, bf16 ``[T, output_width]``.
        A MoeshardError names a hidden-state form the weights do not take, or a missing bias.
        """
        h, t = self.hidden_size, hidden_states.shape[0]
        nvfp4 = "output1_scale_scalar" in self.tensors
        forms = {torch.uint8: (h // 2, 16)} if nvfp4 else {torch.bfloat16: (h, None), torch.float8_e4m3fn: (h, 32)}
        width, vec = forms.get(hidden_states.dtype, (None, None))
        if width is None or tuple(hidden_states.shape) != (t, width):
            want = " or ".join(f"{str(d)[6:]} [T, {w}]" for d, (w, _) in forms.items())
            raise MoeshardError(f"{self.prefix}: hidden_states: expected {want} ({'NVFP4' if nvfp4 else 'MXFP4'} "
                                f"weights, zero-padded to hidden_size {h}), found {str(hidden_states.dtype)[6:]} "
                                f"{list(hidden_states.shape)}")
        s = hidden_states_scale
        if (s is None) != (vec is None) or (s is not None and (s.dtype != torch.float8_e4m3fn
                                                                or s.numel() != t * h // vec)):
            want = f"float8_e4m3fn [T, {h // vec}] (linear)" if vec else "None (bfloat16 hidden states)"
            raise MoeshardError(f"{self.prefix}: hidden_states_scale: expected {want}, found "
                                + ("None" if s is None else f"{str(s.dtype)[6:]} {list(s.shape)}"))
        bias = self.router.get("correction_bias")
        if (routing_bias is None) != (bias is None):
            raise MoeshardError(f"{self.prefix}: routing_bias: " + (
                f"DeepSeekV3 routing needs {bias} (in common/), found None" if bias else
                "expected None (this routing takes no bias; a router bias is added to the logits), found a tensor"))
        kw = static_kernel_args(self.tensors, self.args, self.args)
        kw.update(routing_logits=routing_logits, routing_bias=routing_bias, hidden_states=hidden_states,
                  hidden_states_scale=hidden_states_scale)
        return kw

    def weight_view(self) -> dict[str, torch.Tensor]:
        """The layer's weights for FlashInfer's unified MoE API:
        ``MoEWeightPack().prepare_for("trtllm_fp4_routed", layer.weight_view())`` for
        ``TrtllmFp4RoutedRunner`` (``fused_moe/runners.py`` ``pack_inputs``). The keys are those
        ``prepare_trtllm_fp4_weights`` returns: the four weight tensors, the three output scalars
        and ``gemm1_alpha`` (NVFP4: ones, as it gives), or GPT-OSS's ``gemm1_alpha/beta/clamp_limit``.

        Refused (MoeshardError) where that runner would compute something else: layers with
        biases (GPT-OSS; it passes ``gemm1_bias=None, gemm2_bias=None``) and GEMM2 rows other than
        ``hidden_size`` (the "trimmed" hidden padding; it passes no ``valid_hidden_size``).
        """
        t = self.tensors
        if "gemm1_bias" in t:
            raise MoeshardError(f"{self.prefix}: gemm1_bias, gemm2_bias: FlashInfer's TrtllmFp4RoutedRunner passes "
                                "no biases to the kernel; call trtllm_fp4_block_scale_moe with kernel_kwargs()")
        if t["gemm2_weights"].shape[1] != self.hidden_size:
            raise MoeshardError(f"{self.prefix}: gemm2_weights: FlashInfer's TrtllmFp4RoutedRunner expects "
                                f"{self.hidden_size} rows (no valid_hidden_size), found {t['gemm2_weights'].shape[1]} "
                                "(--hidden-padding trimmed); call trtllm_fp4_block_scale_moe with kernel_kwargs()")
        view = {n: t[n] for n in TENSOR_ARGS if n in t}
        if "output1_scale_scalar" in t:  # prepare_trtllm_fp4_weights: NVFP4 gated kernels take a gate alpha
            view["gemm1_alpha"] = torch.ones_like(t["output1_scale_scalar"])
        return view


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
    :meth:`MoeLayer.kernel_kwargs` and :meth:`MoeLayer.weight_view`.
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
