"""A mixture-of-experts feed-forward: router → routed experts (+ shared experts, optionally gated)."""

from __future__ import annotations

import torch
from torch import nn

from moekit.model.experts import RoutedExperts
from moekit.model.linear import Linear
from moekit.model.mlp import MLP, activation_for
from moekit.model.routing import RoutingDecision, route, route_rows, routing_entropy, with_k
from moekit.model.seated_policy import narrowed, seated_route
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

    def forward(self, x: torch.Tensor, top_k=None, policy=None, entropy: bool = False) -> RoutingDecision:
        """top_k: None for the model's K, else one K per token (moekit.model.routing.route_rows).
        policy: None for the family's routing, else a routing.LayerPolicy (its state is the caller's).
        entropy: the decision carries each token's routing entropy (router health)."""
        bias = self.selection_bias.float() if self.selection_bias is not None else None
        logits = self.logits(x)
        if policy is not None:
            decision = policy.route(logits, self.spec, bias, x)
        elif top_k is None:
            decision = route(logits, self.spec, bias)
        else:
            decision = route_rows(logits, self.spec, bias, top_k)
        if entropy:
            decision.entropy = routing_entropy(logits, self.spec.scoring)
        return decision


def route_each_k(logits: torch.Tensor, specs_by_k: tuple, selection_bias, top_k: torch.Tensor) -> RoutingDecision:
    """route_rows with each row's K a tensor, top_k [T] (1 <= k <= len(specs_by_k), the step's
    width), and no data-dependent Python, so that the compiled step runs it: every row is routed at
    each k (specs_by_k[k - 1], the family's rule with k experts) and keeps its own k's choice. Rows
    narrower than the width repeat their first expert at weight 0, as route_rows pads: the combine
    adds exactly nothing for them. Routing is row-wise, so each row's choice is route_rows'."""
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
        # The family's rule at each K from 1 to E (decode's per-row K, route_each_k: a step routes at
        # each k up to its width, the model's K unless a row asks for more).
        self.specs_by_k = tuple(with_k(spec.router, k) for k in range(1, spec.router.num_experts + 1))
        self.seat = (0, 0)  # (the decoder's PolicySeat handle, this layer's index): set by the Decoder

    def forward(self, x: torch.Tensor, top_k=None, policy=None, entropy: bool = False) -> tuple[torch.Tensor, RoutingDecision]:
        """x [B, T, D] → (out [B, T, D], the decision for the B*T tokens row-major).

        top_k: None for the model's K, else one K per token of the B*T (expert-budget tiers);
        entropy: the decision carries each token's routing entropy (router health)."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)  # [T, D] in the routing legend
        decision = self.router(flat, top_k, policy, entropy)
        out = self.experts(flat, decision)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.view(b, t, d), decision

    def decode(self, x: torch.Tensor, top_k: torch.Tensor | None = None, routing=None) -> tuple[torch.Tensor, RoutingDecision]:
        """The decode step's form (moekit.model.step_ops), the family's routing through the shared
        route(): x [B, D] → (out [B, D], the decision for the B rows, [B, W]). top_k: None for the
        model's K, else each row's K [B] int64, 1 <= k <= W (expert-budget tiers). routing: the
        step's moekit.model.decoder.StepRouting (None: the family's, at the model's K): its width W
        (0: the model's K), whether the decoder's seated policy decides (moekit.model.seated_policy),
        whether the decision carries each row's routing entropy."""
        router = self.router
        logits = project(router, x.to(router.weight.dtype)).float()  # [B, E]
        bias = router.selection_bias.float() if router.selection_bias is not None else None
        width = routing.width if routing is not None and routing.width else router.spec.top_k
        if routing is not None and routing.seated:
            ids, weights = seated_route(logits, x, bias, width, *self.seat)
            decision = RoutingDecision(ids, weights)
        elif top_k is None:
            decision = route(logits, router.spec, bias)
        else:
            decision = route_each_k(logits, self.specs_by_k[:width], bias, top_k)
        if routing is not None and routing.entropy:
            decision.entropy = routing_entropy(logits, router.spec.scoring)  # [B]
        # Eagerly, a policy's narrower decision runs only the forward's products (no zero-weight pads).
        combined = decision if torch.compiler.is_compiling() or routing is None or not routing.seated else narrowed(decision)
        out = self.experts.decode(x, combined)
        if self.shared is not None:
            shared = self.shared.decode(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(project(self.shared_gate, x)) * shared
            out = out + shared
        return out, decision
