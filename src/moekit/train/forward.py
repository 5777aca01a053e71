"""The training forward: the engine's Decoder modules, run over whole sequences with capacity-limited experts.

Attention is the engine's own mixer over a cache made fresh for each batch (start 0, all keys real),
so training and generation share one attention code path. The MoE feed-forward is run here: the
router's logits go through the engine's `route()` (the family's order of softmax, top-K,
normalisation), then a Switch/GShard dispatch with a fixed number of slots per expert: tokens past
an expert's capacity are dropped (they pass through on the residual) and experts run as two batched
matmuls over [E, C, D].

Legend: B batch, S sequence, T = B·S tokens, D hidden, E experts, K per token, C slots per expert, F width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moekit.model.moe import MoE
from moekit.model.routing import route
from moekit.train.aux_losses import (
    capacity,
    capacity_keep,
    capacity_positions,
    load_balance_loss,
    router_probs,
    routing_entropy,
    z_loss,
)


@dataclass(frozen=True)
class RoutingOptions:
    capacity_factor: float = 0.0  # 0: every assignment is served
    jitter: float = 0.0
    expert_dropout: float = 0.0  # each assignment dropped with this probability, the kept × 1/(1-p)
    generator: torch.Generator | None = None  # the jitter's and the dropout's noise


@dataclass
class LayerRouting:
    """One MoE layer's routing in one forward: what the losses and the logs need."""

    topk_ids: Tensor  # [T, K]
    kept: Tensor  # [T, K] bool, False where capacity dropped the assignment
    balance: Tensor  # scalar, differentiable
    z: Tensor  # scalar, differentiable
    probs: Tensor  # [T, E] detached
    entropy: Tensor  # scalar, differentiable: mean per-token entropy of probs, nats


def experts_dispatch(experts, x: Tensor, topk_ids: Tensor, weights: Tensor, kept: Tensor, slots: int) -> Tensor:
    """x [T, D] → Σ_k kept·weight·expert(x), through [E, C, D] slot buffers (the capacity-factor layout)."""
    t, d = x.shape
    e = experts.num_experts
    if slots <= 0:  # no capacity limit: enough slots for the busiest expert
        slots = int(torch.bincount(topk_ids.reshape(-1), minlength=e).max())
    positions = capacity_positions(topk_ids, e)  # [T, K] place in its expert's queue
    token = torch.arange(t, device=x.device)[:, None].expand_as(topk_ids)[kept]  # [N] tokens served
    slot = (topk_ids * slots + positions)[kept]  # [N] flat slot in [E·C]
    buffer = x.new_zeros(e * slots, d).index_add(0, slot, x[token])  # [E·C, D]
    h = torch.bmm(buffer.view(e, slots, d), experts.gate_up.transpose(1, 2))  # [E, C, 2F]
    if experts.gate_up_bias is not None:
        h = h + experts.gate_up_bias[:, None, :]
    y = torch.bmm(experts.act(h), experts.down.transpose(1, 2))  # [E, C, D]
    if experts.down_bias is not None:
        y = y + experts.down_bias[:, None, :]
    served = y.reshape(e * slots, d)[slot] * weights[kept][:, None].to(y.dtype)  # [N, D]
    return x.new_zeros(t, d).index_add(0, token, served)


def moe_forward(moe: MoE, x: Tensor, options: RoutingOptions) -> tuple[Tensor, LayerRouting]:
    """x [B, S, D] → (out [B, S, D], LayerRouting)."""
    b, s, d = x.shape
    flat = x.reshape(b * s, d)  # [T, D]
    router_in = flat
    if options.jitter > 0:
        noise = torch.empty_like(flat).uniform_(1 - options.jitter, 1 + options.jitter, generator=options.generator)
        router_in = flat * noise
    router = moe.router
    logits = router.logits(router_in)  # [T, E] fp32
    bias = router.selection_bias.detach().float() if router.selection_bias is not None else None
    decision = route(logits, router.spec, bias)
    e, k = logits.shape[1], decision.topk_ids.shape[1]
    if options.capacity_factor > 0:
        slots = capacity(b * s, k, e, options.capacity_factor)
        kept = capacity_keep(decision.topk_ids, e, slots)
    else:
        slots, kept = 0, torch.ones_like(decision.topk_ids, dtype=torch.bool)
    weights = decision.topk_weights
    if options.expert_dropout > 0:
        draw = torch.rand(kept.shape, generator=options.generator, device=kept.device)  # [T, K]
        kept = kept & (draw >= options.expert_dropout)
        weights = weights / (1 - options.expert_dropout)
    out = experts_dispatch(moe.experts, flat, decision.topk_ids, weights, kept, slots)
    if moe.shared is not None:
        shared = moe.shared(flat)
        if moe.shared_gate is not None:
            shared = torch.sigmoid(moe.shared_gate(flat)) * shared
        out = out + shared
    probs = router_probs(logits, router.spec.scoring)
    routing = LayerRouting(
        topk_ids=decision.topk_ids,
        kept=kept,
        balance=load_balance_loss(probs, decision.topk_ids),
        z=z_loss(logits),
        probs=probs.detach(),
        entropy=routing_entropy(probs),
    )
    return out.view(b, s, d), routing


def train_forward(decoder, input_ids: Tensor, options: RoutingOptions) -> tuple[Tensor, list[LayerRouting]]:
    """input_ids [B, S] → (logits [B, S, V] fp32, one LayerRouting per MoE layer), causal, no cache kept."""
    b, s = input_ids.shape
    cache = decoder.new_cache(b, s, stacked=False)
    positions = torch.arange(s, device=input_ids.device)[None].expand(b, s)  # [B, S]
    x = decoder.embed(input_ids)
    if decoder.spec.multipliers.embedding != 1.0:
        x = x * decoder.spec.multipliers.embedding
    routings = []
    for i, block in enumerate(decoder.layers):
        h = block.attn(block.input_norm(x), positions, cache.layers[i], 0, cache.key_mask)
        x = x + (h * block.residual if block.residual != 1.0 else h)
        h = block.post_norm(x)
        if isinstance(block.ffn, MoE):
            h, routing = moe_forward(block.ffn, h, options)
            routings.append(routing)
        else:
            h = block.ffn(h)
        x = x + (h * block.residual if block.residual != 1.0 else h)
    return decoder.head(decoder.norm(x)), routings
