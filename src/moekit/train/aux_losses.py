"""Router losses and statistics, as pure functions of one MoE layer's router logits and choices.

Legend: T tokens, E routed experts, K experts per token.

  load-balance (Switch):  E · Σ_i f_i · P_i, f_i = share of the T·K assignments that chose expert i,
                          P_i = mean router probability of i. 1.0 when routing is uniform; f carries
                          no gradient, so the loss pushes probability away from overloaded experts.
  z-loss (ST-MoE):        mean_t logsumexp(logits_t)², keeping router logits small.
  entropy:                mean_t H(p_t), p_t the token's router distribution: a regulariser whose
                          sign decides whether it sharpens (> 0) or flattens (< 0) routing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def router_probs(logits: Tensor, scoring: str) -> Tensor:
    """[T, E] logits → [T, E] probabilities over experts (sigmoid scores are normalised per token)."""
    if scoring == "sigmoid":
        scores = logits.sigmoid()
        return scores / scores.sum(dim=-1, keepdim=True)
    return torch.softmax(logits.float(), dim=-1)


def expert_load(topk_ids: Tensor, num_experts: int) -> Tensor:
    """[T, K] → [E] share of all T·K assignments each expert received (sums to 1)."""
    counts = torch.bincount(topk_ids.reshape(-1), minlength=num_experts).float()
    return counts / topk_ids.numel()


def load_balance_loss(probs: Tensor, topk_ids: Tensor) -> Tensor:
    num_experts = probs.shape[-1]
    f = expert_load(topk_ids, num_experts)  # [E], no gradient
    p = probs.mean(dim=0)  # [E]
    return num_experts * (f * p).sum()


def z_loss(logits: Tensor) -> Tensor:
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def routing_entropy(probs: Tensor) -> Tensor:
    """Mean per-token entropy of the router distribution, in nats (log E when uniform): differentiable,
    the regulariser's term."""
    return -(probs * probs.clamp_min(1e-20).log()).sum(-1).mean()


def router_entropy(probs: Tensor) -> float:
    """routing_entropy as a number, for the logs."""
    return float(routing_entropy(probs))


def imbalance(load: Tensor) -> float:
    """max / mean of the per-expert load: 1.0 is perfect balance, E means one expert takes everything."""
    return float(load.max() / load.mean())


def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Slots per expert: ceil(factor · T·K / E)."""
    return max(1, math.ceil(factor * tokens * top_k / num_experts))


def capacity_positions(topk_ids: Tensor, num_experts: int) -> Tensor:
    """[T, K] → [T, K] each assignment's place in its expert's queue.

    Priority is by choice rank first (every token's first choice is served before any second
    choice), then by token order, as GShard/Switch dispatch does: a token's best expert is the last
    one it loses.
    """
    t, k = topk_ids.shape
    ranked = topk_ids.t().reshape(-1)  # [K·T] rank-major
    one_hot = torch.nn.functional.one_hot(ranked, num_experts)  # [K·T, E]
    position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # [K·T]
    return position.view(k, t).t()


def capacity_keep(topk_ids: Tensor, num_experts: int, slots: int) -> Tensor:
    """[T, K] bool: True where the assignment fits in its expert's `slots`."""
    return capacity_positions(topk_ids, num_experts) < slots
