"""Reference MoE math in float32, on dequantized canonical experts (no kernel layout involved)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moeshard.layouts.kernel import RoutingMethod


def route(logits: torch.Tensor, routing: dict, correction_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids ``[T, k]`` int64 and weights ``[T, k]`` float32 from router logits ``[T, E]``.

    - Renormalize (1, GPT-OSS): top-k of the logits, softmax over the k chosen.
    - RenormalizeNaive (4, Qwen3-MoE with ``norm_topk_prob``): softmax over all experts, top-k,
      divided by their sum (transformers' Qwen3MoeTopKRouter); Default (0): without the division.
    - DeepSeekV3 (2): s = sigmoid(logits); choose with s + correction_bias: group score = sum of
      the group's top-2, keep ``topk_group`` groups, top-k inside them; weights = s at the
      chosen experts, divided by their sum (+1e-20) when ``norm_topk_prob``, times
      ``routed_scaling_factor`` (transformers' DeepseekV3TopkRouter).
    - Llama4 (3): top-1 logit, weight = sigmoid of it (applied to the expert's input).
    """
    method = RoutingMethod(routing["routing_method_type"])
    k = routing["top_k"]
    logits = logits.float()
    if method is RoutingMethod.Renormalize:
        vals, ids = torch.topk(logits, k, dim=-1)
        return ids, torch.softmax(vals, dim=-1)
    if method in (RoutingMethod.RenormalizeNaive, RoutingMethod.Default):
        vals, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        return ids, vals / vals.sum(dim=-1, keepdim=True) if method is RoutingMethod.RenormalizeNaive else vals
    if method is RoutingMethod.DeepSeekV3:
        t, e = logits.shape
        ng, kg = routing["n_group"], routing["topk_group"]
        scores = logits.sigmoid()
        choice = scores + (correction_bias.float() if correction_bias is not None else 0.0)
        group_scores = choice.view(t, ng, e // ng).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=kg, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        mask = mask.unsqueeze(-1).expand(t, ng, e // ng).reshape(t, e)
        ids = torch.topk(choice.masked_fill(~mask, float("-inf")), k=k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        if routing.get("norm_topk_prob", True):
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, w * (routing.get("routed_scaling_factor") or 1.0)
    if method is RoutingMethod.Llama4:
        vals, ids = torch.topk(logits, 1, dim=-1)
        return ids, torch.sigmoid(vals)
    raise ValueError(f"routing_method_type {method} is not supported")


def activate(h1: torch.Tensor, activation: dict, e: int | slice) -> torch.Tensor:
    """GEMM1 output ``[T, 2*I]`` with ``[up ; gate]`` halves -> ``[T, I]`` for local expert ``e``;
    or ``[n, T, 2*I]`` -> ``[n, T, I]`` for the local experts ``e`` (a slice of n).

    ``swiglu_oai`` (GPT-OSS): ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
    ``(up + beta) * gate * sigmoid(alpha * gate)``; alpha, beta, limit are floats or ``[E]``
    tensors (the artifact's per-expert kernel scalars). ``swiglu``: ``silu(gate) * up``.
    """
    i = h1.shape[-1] // 2
    up, gate = h1[..., :i], h1[..., i:]
    if activation["type"] == "swiglu":
        return torch.nn.functional.silu(gate) * up

    def at(k):
        v = activation[k]
        if not isinstance(v, torch.Tensor):
            return v
        v = v[e].to(h1.device)
        return v.view(-1, 1, 1) if isinstance(e, slice) else v

    lim, alpha, beta = at("limit"), at("alpha"), at("beta")
    gate = gate.clamp(max=lim)
    up = up.clamp(min=-lim, max=lim)
    return (up + beta) * gate * torch.sigmoid(alpha * gate)


def moe_forward(x: torch.Tensor, expert: Callable[[int], tuple], expert_ids: Sequence[int], ids: torch.Tensor,
                weights: torch.Tensor, activation: dict, weight_on_input: bool = False) -> torch.Tensor:
    """Sum over the routed experts that this rank holds.

    Parameters
    ----------
    x : ``[T, H]`` float32 hidden states
    expert : local index e -> ``(w13 [2*I, H], w2 [H, I], b13 [2*I] or None, b2 [H] or None)``
        float32, w13 rows ``[up ; gate]``; called once per expert that has tokens, so that only
        one expert is dequantized at a time.
    expert_ids : the global id of each local expert, in local order
    ids, weights : ``[T, k]`` global expert ids and their routing weights
    weight_on_input : scale the expert's input instead of its output (Llama-4)

    Returns
    -------
    ``[T, H]`` float32: ``sum_k weight * (act(x @ w13.T + b13) @ w2.T + b2)`` over the local
    experts only (a rank's partial output).
    """
    lookup = torch.full((max(int(ids.max()), max(expert_ids)) + 1,), -1, dtype=torch.long, device=ids.device)
    lookup[torch.as_tensor(list(expert_ids), device=ids.device)] = torch.arange(len(expert_ids), device=ids.device)
    local = lookup[ids]
    out = None
    for e in torch.unique(local).tolist():
        if e < 0:
            continue
        w13, w2, b13, b2 = expert(e)
        if out is None:
            out = torch.zeros(x.shape[0], w2.shape[0], dtype=torch.float32, device=x.device)
        tok, slot = torch.where(local == e)
        w = weights[tok, slot, None]
        h1 = (x[tok] * w if weight_on_input else x[tok]) @ w13.T
        if b13 is not None:
            h1 = h1 + b13
        y = activate(h1, activation, e) @ w2.T
        if b2 is not None:
            y = y + b2
        out.index_add_(0, tok, y if weight_on_input else y * w)
    return out if out is not None else torch.zeros_like(x)
