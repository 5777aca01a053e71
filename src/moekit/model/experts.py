"""Routed experts stored stacked, and two ways to run them: the obvious one and the fast one.

Weights: gate_up [E, 2F, D] (gate rows then up rows), down [E, D, F]; optional biases [E, 2F], [E, D].
`experts_reference` loops over tokens and their K experts, as one would on paper. `RoutedExperts`
groups tokens by expert (one pair of matmuls per expert that any token chose) and, for a single
token, just runs its K experts. tests/model/test_experts.py checks that the two agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekit.model.mlp import Activation
from moekit.model.routing import RoutingDecision
from moekit.spec.model_spec import MLPSpec


class RoutedExperts(nn.Module):
    def __init__(self, spec: MLPSpec, num_experts: int, act: Activation):
        super().__init__()
        rows = (2 if spec.gated else 1) * spec.width
        self.num_experts = num_experts
        self.gate_up = nn.Parameter(torch.empty(num_experts, rows, spec.hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, spec.hidden_size, spec.width))
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, rows)) if spec.bias else None
        self.down_bias = nn.Parameter(torch.empty(num_experts, spec.hidden_size)) if spec.bias else None
        self.act = act

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x [N, D] → [N, D]."""
        up_bias = self.gate_up_bias[e] if self.gate_up_bias is not None else None
        down_bias = self.down_bias[e] if self.down_bias is not None else None
        return F.linear(self.act(F.linear(x, self.gate_up[e], up_bias)), self.down[e], down_bias)

    def forward(self, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
        """x [T, D] → Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t]), [T, D]."""
        if x.shape[0] == 1:
            return self._one_token(x, decision)
        return self._grouped(x, decision)

    def _one_token(self, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
        ids = decision.topk_ids[0].tolist()
        weights = decision.topk_weights[0].tolist()  # Python floats: no tensor op per scalar
        out = self.expert(ids[0], x) * weights[0]
        for e, w in zip(ids[1:], weights[1:]):
            out = out + self.expert(e, x) * w
        return out

    def _grouped(self, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
        top_k = decision.topk_ids.shape[1]
        flat_ids = decision.topk_ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat_ids, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // top_k  # [T*K] the token of each sorted assignment
        weight_of = decision.topk_weights.reshape(-1)[order]
        chosen = x[token_of]  # [T*K, D]
        out = torch.zeros_like(x)
        begin = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(begin, begin + n)
            y = self.expert(e, chosen[rows]) * weight_of[rows, None]
            out.index_add_(0, token_of[rows], y.to(x.dtype))
            begin += n
        return out


def experts_reference(experts: RoutedExperts, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
    """The slow obvious sum: for every token, for each of its K experts, add weight × expert(token)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(decision.topk_ids.shape[1]):
            e = int(decision.topk_ids[t, k])
            y = experts.expert(e, x[t : t + 1])[0]
            out[t] += (y * decision.topk_weights[t, k]).to(x.dtype)
    return out
