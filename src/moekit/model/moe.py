"""A mixture-of-experts feed-forward: router → routed experts (+ shared experts, optionally gated)."""

from __future__ import annotations

import torch
from torch import nn

from moekit.model.experts import RoutedExperts
from moekit.model.linear import Linear
from moekit.model.mlp import MLP, activation_for
from moekit.model.routing import RoutingDecision, route, route_rows, with_k
from moekit.model.step_ops import project
from moekit.spec.model_spec import MoESpec, RouterSpec


class Router(Linear):
    """logits = x Wᵀ (+ b); selection_bias is DeepSeek's e_score_correction_bias (choosing only)."""

    def __init__(self, spec: RouterSpec, hidden_size: int):
        super().__init__(hidden_size, spec.num_experts, bias=spec.bias)
        self.spec = spec
        self.selection_bias = nn.Parameter(torch.empty(spec.num_experts)) if spec.selection_bias else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] → [T, E] fp32. With spec.fp32 the weight is kept in fp32 and the GEMM runs there."""
        bias = self.bias.to(self.weight.dtype) if self.bias is not None else None
        return self.kernel.apply(x.to(self.weight.dtype), self.weight, bias).float()

    def forward(self, x: torch.Tensor, top_k=None, policy=None) -> RoutingDecision:
        """top_k: None for the model's K, else one K per token (moekit.model.routing.route_rows).
        policy: None for the family's routing, else a routing.LayerPolicy (its state is the caller's)."""
        bias = self.selection_bias.float() if self.selection_bias is not None else None
        if policy is not None:
            return policy.route(self.logits(x), self.spec, bias, x)
        if top_k is None:
            return route(self.logits(x), self.spec, bias)
        return route_rows(self.logits(x), self.spec, bias, top_k)


def route_each_k(logits: torch.Tensor, specs_by_k: tuple, selection_bias, top_k: torch.Tensor) -> RoutingDecision:
    """route_rows with each row's K a tensor, top_k [T] (1 <= k <= len(specs_by_k), the model's K),
    and no data-dependent Python, so that the compiled step runs it: every row is routed at each k
    (specs_by_k[k - 1], the family's rule with k experts) and keeps its own k's choice. Rows narrower
    than the model's K repeat their first expert at weight 0, as route_rows pads: the combine adds
    exactly nothing for them. Routing is row-wise, so each row's choice is route_rows'."""
    tokens, widest = logits.shape[0], len(specs_by_k)
    ids = torch.zeros((tokens, widest), dtype=torch.int64, device=logits.device)  # [T, K]
    weights = torch.zeros((tokens, widest), dtype=torch.float32, device=logits.device)  # [T, K]
    for k, spec in enumerate(specs_by_k, start=1):
        part = route(logits, spec, selection_bias)  # [T, k]
        pad = widest - k
        part_ids = torch.cat((part.topk_ids, part.topk_ids[:, :1].expand(tokens, pad)), dim=1)
        part_weights = torch.nn.functional.pad(part.topk_weights.float(), (0, pad))
        mine = (top_k == k)[:, None]  # [T, 1]
        ids = torch.where(mine, part_ids, ids)
        weights = torch.where(mine, part_weights, weights)
    return RoutingDecision(topk_ids=ids, topk_weights=weights)


class MoE(nn.Module):
    def __init__(self, spec: MoESpec, extras: dict):
        super().__init__()
        d = spec.expert.hidden_size
        self.router = Router(spec.router, d)
        self.experts = RoutedExperts(spec.expert, spec.num_experts, activation_for(spec.expert, extras))
        self.shared = MLP(spec.shared, activation_for(spec.shared, extras)) if spec.shared is not None else None
        self.shared_gate = Linear(d, 1, bias=False) if spec.shared_gate else None
        self.experts.weigh_input = spec.weigh_input
        # The family's rule at each K from 1 to the model's (decode's per-row K, route_each_k).
        self.specs_by_k = tuple(with_k(spec.router, k) for k in range(1, spec.router.top_k + 1))

    def forward(self, x: torch.Tensor, top_k=None, policy=None) -> tuple[torch.Tensor, RoutingDecision]:
        """x [B, T, D] → (out [B, T, D], the decision for the B*T tokens row-major).

        top_k: None for the model's K, else one K per token of the B*T (expert-budget tiers)."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)  # [T, D] in the routing legend
        decision = self.router(flat, top_k, policy)
        out = self.experts(flat, decision)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.view(b, t, d), decision

    def decode(self, x: torch.Tensor, top_k: torch.Tensor | None = None) -> tuple[torch.Tensor, RoutingDecision]:
        """The decode step's form (moekit.model.step_ops), the family's routing through the shared
        route(): x [B, D] → (out [B, D], the decision for the B rows). top_k: None for the model's
        K, else each row's K [B] int64, 1 <= k <= the model's K (expert-budget tiers)."""
        router = self.router
        logits = project(router, x.to(router.weight.dtype)).float()  # [B, E]
        bias = router.selection_bias.float() if router.selection_bias is not None else None
        if top_k is None:
            decision = route(logits, router.spec, bias)
        else:
            decision = route_each_k(logits, self.specs_by_k, bias, top_k)
        out = self.experts.decode(x, decision)
        if self.shared is not None:
            shared = self.shared.decode(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(project(self.shared_gate, x)) * shared
            out = out + shared
        return out, decision
