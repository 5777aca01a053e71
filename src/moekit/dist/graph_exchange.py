"""Rank 0's expert exchange called from inside the compiled decode step, as one opaque op.

The compiled step (moekit.model.compiled_step) is one Inductor graph; the exchange is collectives
and Python (rank 0's order to the other ranks, then ExpertParallelLayer.forward) that no graph can
hold. So on rank 0 each MoE layer's routed experts are `moekit::ep_experts(x, ids, weights, handle)`:
a custom op that Dynamo leaves as a call and Inductor calls between its kernels (from its C++ wrapper
too); its fake says only "a [B, D] like x". Everything else in the step (attention, routers, shared
experts, norms, head) stays compiled, and the exchange is exactly the eager one, so the tokens are
those of the eager sharded server (tests/serve/test_sharded_server.py).

An op's arguments are tensors and numbers, not Python objects: `handle` is a key into `_STORES`, a
table of weak references to the LeaderStores that registered (one per MoE layer of each sharded
engine in this process; a store that is gone leaves the table with it).

Legend: B rows of the step, D hidden, K experts per row.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from moekit.model.routing import RoutingDecision

_STORES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def register(store) -> int:
    """A handle by which the op finds `store` (a moekit.dist.serving.LeaderStore)."""
    handle = next(_HANDLES)
    _STORES[handle] = store
    return handle


@torch.library.custom_op("moekit::ep_experts", mutates_args=())
def ep_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, handle: int) -> torch.Tensor:
    """x [B, D], ids [B, K] int64, weights [B, K] → Σ_k weights[b, k] · expert_{ids[b, k]}(x[b]), [B, D],
    computed by the ranks holding the experts (the store's forward: the order, then the exchange)."""
    store = _STORES.get(handle)
    if store is None:
        raise RuntimeError(f"moekit::ep_experts: no expert-parallel layer has handle {handle} in this process")
    return store.forward(store.experts, x, RoutingDecision(ids, weights))


@ep_experts.register_fake
def _(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty_like(x)
