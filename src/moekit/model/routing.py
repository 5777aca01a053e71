"""Expert choice: one `route()` runs every family; the family's order of operations is RouterSpec data.

Names follow Megatron-LM: router `logits` [T, E] → `scores` (softmax or sigmoid, what chooses) →
`topk_ids` [T, K] and `topk_weights` [T, K] (what combines the chosen experts' outputs).

Orders reproduced from transformers 5.24:
  score_then_topk + softmax  (mixtral, qwen*, olmoe): softmax(fp32) over E, top-K, / sum if normalize.
  score_then_topk + sigmoid  (deepseek_v3): sigmoid; selection_bias is added for CHOOSING only; group
      score = sum of the top-2 choice scores in each of n_group groups; experts outside the best
      topk_group groups are masked with -inf; top-K; weights = unbiased sigmoid scores of the chosen,
      / (sum + 1e-20) if normalize.
  topk_then_score (gpt_oss, granitemoe): top-K on the raw logits, softmax over those K.
Every order ends with × scaling (routed_scaling_factor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moekit.spec.model_spec import RouterSpec


@dataclass
class RoutingDecision:
    topk_ids: Tensor  # [T, K] int64, tokens of all rows flattened row-major
    topk_weights: Tensor  # [T, K] float32, the weights that combine expert outputs


def _group_limited(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """choice [T, E] → the same with experts outside the best `topk_group` groups set to -inf."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, n_group, experts // n_group)  # [T, G, E/G]
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    drop = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, False)  # [T, G]
    return grouped.masked_fill(drop.unsqueeze(-1), float("-inf")).view(tokens, experts)


def _choose(scores: Tensor, spec: RouterSpec, selection_bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """scores [T, E] fp32 → (topk_ids [T, K], their scores or None when the choice was steered).

    The bias and the group limit steer the choice only; without them top-K's values are the scores.
    """
    steered = selection_bias is not None or (spec.n_group > 1 and spec.topk_group < spec.n_group)
    choice = scores + selection_bias if selection_bias is not None else scores
    if spec.n_group > 1 and spec.topk_group < spec.n_group:
        choice = _group_limited(choice, spec.n_group, spec.topk_group)
    values, ids = torch.topk(choice, k=spec.top_k, dim=-1)
    return ids, None if steered else values


def _score_then_topk(logits: Tensor, spec: RouterSpec, selection_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    scores = logits.sigmoid() if spec.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    topk_ids, weights = _choose(scores, spec, selection_bias)
    if weights is None:
        weights = scores.gather(1, topk_ids)  # [T, K] the unsteered scores of the chosen
    if spec.normalize:
        # deepseek adds 1e-20 (sigmoid scores never sum to 0); the softmax families divide plainly
        eps = 1e-20 if spec.scoring == "sigmoid" else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    return topk_ids, weights


def _topk_then_softmax(logits: Tensor, spec: RouterSpec) -> tuple[Tensor, Tensor]:
    top_logits, topk_ids = torch.topk(logits, spec.top_k, dim=-1)
    return topk_ids, torch.softmax(top_logits, dim=-1)


def route(logits: Tensor, spec: RouterSpec, selection_bias: Tensor | None = None) -> RoutingDecision:
    """logits [T, E] (made fp32 here: every reference scores in fp32) → RoutingDecision."""
    logits = logits.float()
    if spec.order == "topk_then_score":
        topk_ids, weights = _topk_then_softmax(logits, spec)
    else:
        topk_ids, weights = _score_then_topk(logits, spec, selection_bias)
    if spec.scaling != 1.0:
        weights = weights * spec.scaling
    return RoutingDecision(topk_ids=topk_ids, topk_weights=weights)
