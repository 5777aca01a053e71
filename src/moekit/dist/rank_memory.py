"""What a rank keeps in memory: its own experts, on their own storage; a serving follower nothing else.

A loader may fill the whole checkpoint into one buffer (every weight a slice of it): then any one
weight kept keeps all of it, the other ranks' experts included. `own_storage` gives each weight of
a sharded decoder its own storage, so that the buffer goes once the other ranks' experts are dropped.

A follower of `moekit serve --expert-parallel` receives each MoE layer's tokens and routing from
rank 0 (serving.py), so the embeddings, the head, the norms, attention, the routers, the shared
experts and the dense layers it loaded would only sit in memory; nor does it ever allocate a KV cache.
`keep_only_experts` drops them once the experts are sharded (`moekit run --expert-parallel` keeps
them: there every rank runs the whole forward). `weight_bytes` is what /metrics and the tests read.
"""

from __future__ import annotations

import torch
from torch import nn


def keep_only_experts(decoder: nn.Module, moe_layers) -> None:
    """Drop every module of `decoder` but the routed experts of `moe_layers` (their prepared
    weights live in the expert-parallel layers, `experts.store`)."""
    moe = set(moe_layers)
    decoder.embed = decoder.norm = decoder.lm_head = None
    decoder.head_bias = None
    for i, block in enumerate(decoder.layers):
        block.input_norm = block.attn = block.post_norm = None
        if i in moe:
            block.ffn.router = block.ffn.shared = block.ffn.shared_gate = None
        else:
            block.ffn = None


def own_storage(decoder: nn.Module) -> None:
    """Every parameter and buffer of `decoder` that shares a larger storage copied onto its own."""
    for module in decoder.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None and not t.is_meta and shares_storage(t):
                    copy = t.detach().clone()
                    table[name] = nn.Parameter(copy, requires_grad=False) if isinstance(t, nn.Parameter) else copy


def shares_storage(t: torch.Tensor) -> bool:
    """Whether `t` is part of a larger storage (a view, or a slice of one buffer)."""
    return t._base is not None or t.untyped_storage().nbytes() > t.numel() * t.element_size()


def _tensors(module: nn.Module):
    """Every tensor a module holds itself: parameters, buffers and plain tensor attributes (a
    prepared fusion, say)."""
    yield from module._parameters.values()
    yield from module._buffers.values()
    for value in vars(module).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, tuple):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _nbytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def weight_bytes(decoder: nn.Module, layers: dict) -> dict:
    """{"dense": bytes of every tensor outside the routed experts and the RoPE tables,
    "experts": bytes of the routed experts this rank holds}. layers: MoE layer → its
    ExpertParallelLayer (whose `weights` hold this rank's experts; None when they are paged)."""
    from moekit.model.experts import RoutedExperts
    from moekit.model.rope import Rope

    seen: set = set()
    expert_modules = [sub for m in decoder.modules() if isinstance(m, RoutedExperts) for sub in m.modules()]
    experts = sum(_nbytes(_tensors(m), seen) for m in expert_modules)
    for layer in layers.values():
        for held in (layer.weights or {}).values():
            experts += _nbytes(held, seen)
    skip = {id(m) for m in expert_modules} | {id(m) for m in decoder.modules() if isinstance(m, Rope)}
    dense = sum(_nbytes(_tensors(m), seen) for m in decoder.modules() if id(m) not in skip)
    return {"dense": dense, "experts": experts}
