"""FlashInfer's ``trtllm_fp4_block_scale_moe`` as data: the table of kernel tensors (name, dtype,
shape rule, what it is made of), the routing and activation enums, the kernel scalars, and the
static arguments of one rank and layer.

The plan (which tensors a rank file holds), the converter (which canonical field each is made
of), :func:`moeshard.load_rank` and the trtllm-gen validation backend (which arguments the kernel
gets) all derive from :data:`KERNEL_TENSORS`. Pure: no files, families or devices.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch


class RoutingMethod(enum.IntEnum):
    """``flashinfer.tllm_enums.RoutingMethodType`` (the values the kernel takes)."""

    Default = 0  # Softmax -> TopK
    Renormalize = 1  # TopK -> Softmax (GPT-OSS)
    DeepSeekV3 = 2  # Sigmoid, + bias for the choice, grouped TopK, renormalise, x scaling factor
    Llama4 = 3  # Top1 -> Sigmoid
    RenormalizeNaive = 4  # Softmax -> TopK -> renormalise


class ActivationType(enum.IntEnum):
    """``flashinfer.tllm_enums.ActivationType`` (FP4 MoE: gated SwiGLU, with GPT-OSS's clamp and
    alpha/beta given as the ``gemm1_alpha/beta/clamp_limit`` tensors)."""

    Swiglu = 3


class SfLayout(enum.IntEnum):
    """``flashinfer.tllm_enums.SfLayout``: the activation scales' layout, declared with
    ``hidden_states_scale_layout`` (the kernel takes only ``layout_linear``; omitting it warns)."""

    layout_128x4 = 0
    layout_8x4 = 1
    layout_linear = 2


#: How GEMM2 (the down projection) is padded along the hidden size (``convert --hidden-padding``):
#: "vllm" stores it with the padded hidden size (3072 rows for GPT-OSS's 2880, what vLLM and SGLang
#: build; the kernel is called without ``valid_hidden_size``), "trimmed" with roundUp(hidden size,
#: 128) rows (2944), FlashInfer's ``valid_hidden_size`` form. GEMM1's K and the hidden states keep
#: the padded size in both.
HIDDEN_PADDINGS = ("vllm", "trimmed")
#: FlashInfer rounds ``valid_hidden_size`` up to this for GEMM2's N (``core.py``
#: ``_TRTLLM_MOE_OUTPUT_HIDDEN_ALIGNMENT``, launcher ``kTrtllmMoeOutputHiddenAlignment``).
OUTPUT_HIDDEN_ALIGNMENT = 128


def gemm2_rows(hidden_size: int, hidden_size_padded: int, hidden_padding: str) -> int:
    """GEMM2's rows (the kernel's GEMM2 N; also ``gemm2_bias``'s length): ``hidden_size_padded``
    for "vllm", ``roundUp(hidden_size, 128)`` for "trimmed" (FlashInfer 0.7.2
    ``_infer_trtllm_moe_output_hidden_size``, launcher ``moe_hidden_size_output``)."""
    if hidden_padding == "vllm":
        return hidden_size_padded
    return -(-hidden_size // OUTPUT_HIDDEN_ALIGNMENT) * OUTPUT_HIDDEN_ALIGNMENT


#: Which tensors a layer has, by what the checkpoint brings.
WEIGHTS, BIASES, SWIGLU_OAI, NVFP4 = "weights", "biases", "swiglu_oai", "nvfp4"


@dataclass(frozen=True)
class KernelTensor:
    """One tensor of a rank's layer, named as FlashInfer's parameter (``hidden_states_scale_global``:
    the global scale to quantize the hidden states with, not a kernel argument itself)."""

    name: str
    dtype: str  # safetensors dtype code
    #: (local experts, H padded (GEMM1's K), GEMM2's rows (:func:`gemm2_rows`), I padded, sf) -> shape
    shape: Callable[[int, int, int, int, int], tuple[int, ...]]
    field: str | None  # the canonical field it is made of (None: a scalar computed by kernel_scalars)
    group: str  # WEIGHTS, BIASES, SWIGLU_OAI or NVFP4
    kernel_arg: bool = True


#: Every kernel tensor, in the order files are written (the writer then puts wider dtypes first).
KERNEL_TENSORS = (
    KernelTensor("gemm1_weights", "U8", lambda e, h, n2, i, sf: (e, 2 * i, h // 2), "w13", WEIGHTS),
    KernelTensor("gemm1_weights_scale", "F8_E4M3", lambda e, h, n2, i, sf: (e, 2 * i, h // sf), "w13_scale", WEIGHTS),
    KernelTensor("gemm2_weights", "U8", lambda e, h, n2, i, sf: (e, n2, i // 2), "w2", WEIGHTS),
    KernelTensor("gemm2_weights_scale", "F8_E4M3", lambda e, h, n2, i, sf: (e, n2, i // sf), "w2_scale", WEIGHTS),
    KernelTensor("gemm1_bias", "F32", lambda e, h, n2, i, sf: (e, 2 * i), "w13_bias", BIASES),
    KernelTensor("gemm2_bias", "F32", lambda e, h, n2, i, sf: (e, n2), "w2_bias", BIASES),
    KernelTensor("gemm1_alpha", "F32", lambda e, h, n2, i, sf: (e,), None, SWIGLU_OAI),
    KernelTensor("gemm1_beta", "F32", lambda e, h, n2, i, sf: (e,), None, SWIGLU_OAI),
    KernelTensor("gemm1_clamp_limit", "F32", lambda e, h, n2, i, sf: (e,), None, SWIGLU_OAI),
    KernelTensor("output1_scale_scalar", "F32", lambda e, h, n2, i, sf: (e,), None, NVFP4),
    KernelTensor("output1_scale_gate_scalar", "F32", lambda e, h, n2, i, sf: (e,), None, NVFP4),
    KernelTensor("output2_scale_scalar", "F32", lambda e, h, n2, i, sf: (e,), None, NVFP4),
    KernelTensor("hidden_states_scale_global", "F32", lambda e, h, n2, i, sf: (), None, NVFP4, kernel_arg=False),
)
#: Kernel tensor name -> the canonical field it is made of (the row tensors).
KERNEL_FIELDS = {t.name: t.field for t in KERNEL_TENSORS if t.field}
#: The tensor arguments of ``trtllm_fp4_block_scale_moe`` a rank provides (absent ones are None).
TENSOR_ARGS = tuple(t.name for t in KERNEL_TENSORS if t.kernel_arg)


def kernel_tensors(groups: set[str] | frozenset[str]) -> list[KernelTensor]:
    """The kernel tensors of a layer with these groups (always WEIGHTS; BIASES and SWIGLU_OAI for
    GPT-OSS; NVFP4 for NVFP4 weights), in file order."""
    return [t for t in KERNEL_TENSORS if t.group in groups]


def kernel_shape_problems(h_pad: int, i_pad: int, sf: int) -> list[str]:
    """Why padded sizes ``h_pad``, ``i_pad`` do not fit the trtllm-gen layout without interleave
    padding (rows multiples of 128, scale columns of 4, sizes of the scale block); [] if they do."""
    problems = []
    if h_pad % 128:
        problems.append(f"hidden size {h_pad} (gemm2 rows) not a multiple of 128")
    if (2 * i_pad) % 128:
        problems.append(f"2 x intermediate size {2 * i_pad} (gemm1 rows) not a multiple of 128")
    if (h_pad // sf) % 4 or (i_pad // sf) % 4:
        problems.append(f"scale columns {h_pad // sf}, {i_pad // sf} not multiples of 4")
    if h_pad % sf or i_pad % sf:
        problems.append(f"sizes {h_pad}, {i_pad} not multiples of the scale block {sf}")
    return problems


#: FlashInfer 0.7.2.post1's compiled routing tiers (numExperts <= E, topK <= K) per routing policy
#: (``include/flashinfer/trtllm/fused_moe/RoutingCustomPolicy.cuh:840-880``): an (experts, top-k)
#: pair no tier covers only logs a warning there and routes wrongly, so it is refused here.
ROUTING_TIERS = {
    "softmax_topk": ((128, 8), (256, 8)),  # Default: Softmax -> TopK (no renormalisation)
    "topk_softmax": ((128, 4), (128, 8), (160, 8), (256, 8), (256, 16), (512, 8), (512, 16), (512, 22), (512, 32),
                     (576, 8), (768, 32), (896, 16), (1024, 32), (2048, 32)),  # Renormalize, RenormalizeNaive
    "sigmoid_bias": ((128, 8), (256, 8), (384, 8), (512, 8), (512, 22), (896, 16), (1024, 32)),  # DeepSeekV3, 1 group
}


def routing_problems(routing: dict, num_experts: int) -> list[str]:
    """Why FlashInfer 0.7.2.post1's trtllm-gen FP4 MoE cannot route ``routing`` over ``num_experts``
    experts ([] if it can). Its launcher checks none of this before the GPU (the Python wrapper
    only validates fused shared experts and routing_replay_out), so an unsupported model would fail
    on the serving machine, or route silently wrong where a routing tier is missing.

    Limits, from ``data/csrc/fused_moe/trtllm_backend/``: ``trtllm_fused_moe_routing_runner.cu:160-161``
    (DeepSeekV3 with groups: topK <= 22, topkGroup <= 4), ``:222`` (Llama4: topK == 1);
    ``trtllm_fused_moe_routing_deepseek.cu:51-62, 526-566`` (<= 512 experts, <= 8 groups, experts
    divisible by 4 and by the groups, <= 32 experts per group, topkGroup <= nGroup);
    ``trtllm_fused_moe_routing_llama4.cu:28-30`` (<= 128 experts); the tiers above; and
    ``trtllm_fused_moe_kernel_launcher.cu:1394`` (1 <= top_k <= num_experts).
    """
    m, k, e = RoutingMethod(routing["routing_method_type"]), routing["top_k"], num_experts
    ng, kg = routing.get("n_group") or 0, routing.get("topk_group") or 0
    problems = [] if 1 <= k <= e else [f"top_k {k} must be in 1..{e} (the expert count)"]

    def tiers(policy: str, what: str) -> None:
        if not any(e <= te and k <= tk for te, tk in ROUTING_TIERS[policy]):
            problems.append(f"{what} routing has no kernel for {e} experts with top_k {k} (FlashInfer's compiled "
                            f"tiers: {', '.join(f'{te} experts/top {tk}' for te, tk in ROUTING_TIERS[policy])})")

    if m is RoutingMethod.Llama4:
        problems += [f"Llama4 routing needs top_k 1, found {k}"] * (k != 1)
        problems += [f"Llama4 routing takes at most 128 experts, found {e}"] * (e > 128)
    elif m in (RoutingMethod.Renormalize, RoutingMethod.RenormalizeNaive):
        tiers("topk_softmax", m.name)
    elif m is RoutingMethod.Default:
        tiers("softmax_topk", "Default (softmax, no renormalisation)")
    elif m is RoutingMethod.DeepSeekV3 and ng <= 1:
        tiers("sigmoid_bias", "DeepSeekV3 (one group)")
        if routing.get("norm_topk_prob") is False:
            problems.append("DeepSeekV3 routing with one group always renormalises the top-k weights; "
                            "norm_topk_prob false is not supported")
    elif m is RoutingMethod.DeepSeekV3:
        for bad, why in ((k > 22, f"top_k {k} > 22"), (kg > 4, f"topk_group {kg} > 4"), (ng > 8, f"n_group {ng} > 8"),
                         (kg > ng, f"topk_group {kg} > n_group {ng}"), (e > 512, f"{e} experts > 512"),
                         (e % 4 or e % ng, f"{e} experts not divisible by 4 and by n_group {ng}"),
                         (ng and e // ng > 32, f"{e // max(ng, 1)} experts per group > 32")):
            if bad:
                problems.append(f"DeepSeekV3 grouped routing: {why}")
    return problems


# -- kernel scalars -------------------------------------------------------------------------------
def swiglu_oai_scalars(num_experts: int, limit: float, alpha: float, beta: float) -> dict[str, torch.Tensor]:
    """``gemm1_alpha``, ``gemm1_beta``, ``gemm1_clamp_limit``: float32 ``[E]`` each (GPT-OSS's
    clamped SwiGLU: ``(clamp(up, ±limit) + beta) * g * sigmoid(alpha * g)``, g = min(gate, limit))."""
    full = lambda v: torch.full((num_experts,), v, dtype=torch.float32)  # noqa: E731
    return {"gemm1_alpha": full(alpha), "gemm1_beta": full(beta), "gemm1_clamp_limit": full(limit)}


def nvfp4_scalars(w1_scale_2: torch.Tensor, w3_scale_2: torch.Tensor, w2_scale_2: torch.Tensor,
                  a13: torch.Tensor, a2: torch.Tensor) -> dict[str, torch.Tensor]:
    """Kernel scalars of an NVFP4 x NVFP4 layer, exact when gate and up have different scales.

    Parameters
    ----------
    w1_scale_2, w3_scale_2, w2_scale_2 : ``[E]`` float32, the local experts' ``weight_scale_2`` of
        gate (w1), up (w3) and down (w2)
    a13, a2 : ``[]`` float32, maxima of the GEMM1 / GEMM2 ``input_scale`` over ALL experts of
        the layer (so identical on every rank)

    Returns
    -------
    ``output1_scale_gate_scalar = a13 * w1_scale_2``, ``output1_scale_scalar = (1 / a2) *
    (a13 * w3_scale_2)``, ``output2_scale_scalar = a2 * w2_scale_2`` (float32 ``[E]``), and
    ``hidden_states_scale_global = 1 / a13`` (float32 ``[]``), the global scale to quantize the
    hidden states with.

    The kernel's gated activation is ``scaleC * x0 * (x1 * scaleGate) * sigmoid(x1 * scaleGate)``
    with x0 = up and x1 = gate raw GEMM outputs, scaleGate = ``output1_scale_gate_scalar`` and
    scaleC = ``output1_scale_scalar`` (FlashInfer ``include/flashinfer/trtllm/batched_gemm/
    KernelRunner.h``, ActType), so the up half's dequantization lives in ``output1_scale_scalar``
    and the gate half's in ``output1_scale_gate_scalar``. vLLM applies gate's scale to both
    halves (``w13_weight_scale_2[:, 0]``); where the two are equal the bytes are vLLM's, whose
    ``g1_scale_c = w2_input_scale_quant * g1_alphas`` multiplies by ``1 / a2`` (one ulp from
    dividing by a2).
    """
    a13, a2 = a13.float(), a2.float()
    return {
        "output1_scale_gate_scalar": (a13 * w1_scale_2.float()).float(),
        "output1_scale_scalar": (1.0 / a2) * (a13 * w3_scale_2.float()).float(),
        "output2_scale_scalar": (a2 * w2_scale_2.float()).float(),
        "hidden_states_scale_global": (1.0 / a13).reshape(()),
    }


def kernel_scalars(activation: dict, n: int, scale_2: dict[str, torch.Tensor] | None = None,
                   input_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The kernel scalars of ``n`` experts: the SwiGLU-OAI constants of ``activation`` (GPT-OSS),
    and, given ``scale_2`` (``w1_scale_2``, ``w3_scale_2``, ``w2_scale_2``: ``[n]`` each) and the
    layer's ``(a13, a2)``, NVFP4's output scales. Float32 ``[n]`` each
    (``hidden_states_scale_global`` ``[]``)."""
    out: dict[str, torch.Tensor] = {}
    if activation["type"] == "swiglu_oai":
        out.update(swiglu_oai_scalars(n, activation["limit"], activation["alpha"], activation["beta"]))
    if input_scales is not None:
        out.update(nvfp4_scalars(scale_2["w1_scale_2"], scale_2["w3_scale_2"], scale_2["w2_scale_2"], *input_scales))
    return out


# -- the kernel's static arguments ----------------------------------------------------------------
def static_kernel_args(tensors: dict[str, torch.Tensor], kernel_args: dict, rank: dict) -> dict:
    """Every argument of ``trtllm_fp4_block_scale_moe`` that does not depend on the tokens, each
    given explicitly (FlashInfer 0.7.2.post1 warns where ``hidden_states_scale_layout`` is left out).

    Parameters
    ----------
    tensors : the rank's tensors of one layer, keyed by FlashInfer parameter name
    kernel_args : the manifest's ``kernel_args`` of the layer (``valid_hidden_size`` only in the
        "trimmed" hidden padding: GEMM2 then has roundUp(valid_hidden_size, 128) rows)
    rank : ``local_expert_offset`` and ``local_num_experts`` of the rank

    The caller adds ``routing_logits`` ``[T, num_experts]`` (f32 or bf16), ``routing_bias``
    (DeepSeek: ``e_score_correction_bias``), ``hidden_states`` (``[T, hidden_size]``: bf16 or
    MXFP8 for MXFP4 weights; NVFP4 packed ``[T, hidden_size/2]`` uint8 quantized with
    ``hidden_states_scale_global``) and ``hidden_states_scale`` (linear layout, as declared here).
    """
    if rank.get("local_expert_offset") is None:
        raise ValueError("round-robin ranks have no local_expert_offset: the trtllm-gen kernel needs "
                         "contiguous experts")
    args = {name: tensors.get(name) for name in TENSOR_ARGS}
    args.update(num_experts=kernel_args["num_experts"], top_k=kernel_args["top_k"], n_group=kernel_args.get("n_group"),
                topk_group=kernel_args.get("topk_group"), intermediate_size=kernel_args["intermediate_size"],
                local_expert_offset=rank["local_expert_offset"], local_num_experts=rank["local_num_experts"],
                routed_scaling_factor=kernel_args.get("routed_scaling_factor"),
                routing_method_type=kernel_args["routing_method_type"],
                activation_type=kernel_args.get("activation_type", ActivationType.Swiglu), do_finalize=True,
                norm_topk_prob=kernel_args.get("norm_topk_prob", True),
                valid_hidden_size=kernel_args.get("valid_hidden_size"),
                hidden_states_scale_layout=SfLayout.layout_linear)
    return args
