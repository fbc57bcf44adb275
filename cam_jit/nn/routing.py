"""Router conventions: from router logits to (topk_ids, topk_weights) for `fused_deep_moe`.

Each function computes what the model family's own router computes, in the same torch
operations, so that the chosen experts and their weights agree bit for bit.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["ROUTINGS", "sigmoid_group_topk", "softmax_topk"]

ROUTINGS = ("softmax", "sigmoid_group")


def softmax_topk(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax-then-top-k routing (Qwen2-MoE, Qwen3-MoE; Mixtral's top-k-then-softmax is the same
    with norm_topk_prob=True): probabilities = softmax(float32(logits)), the top_k largest
    (torch.topk order), renormalised to sum 1 when norm_topk_prob.

    Args:
        router_logits: [T, E] float.
    Returns:
        (topk_ids [T, top_k] int32, topk_weights [T, top_k] float32).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


def sigmoid_group_topk(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool, *,
                       correction_bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
                       routed_scaling_factor: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: scores = sigmoid(float32(logits)); experts are chosen by
    scores + correction_bias, among the topk_group of n_group expert groups with the largest sum
    of their two best biased scores; their weights are the unbiased scores, renormalised (plus
    1e-20) when norm_topk_prob, times routed_scaling_factor.

    Args:
        router_logits: [T, E] float, E a multiple of n_group.
        correction_bias: [E] float32 (e_score_correction_bias), or None for zeros.
    Returns:
        (topk_ids [T, top_k] int32, topk_weights [T, top_k] float32).
    """
    experts = router_logits.shape[-1]
    scores = router_logits.to(torch.float32).sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    group_scores = choice.view(-1, n_group, experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, experts // n_group).reshape(-1, experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), weights * routed_scaling_factor
