"""The expert store called from inside the compiled decode step, as two opaque ops.

The compiled step (moekit.model.compiled_step) is one Inductor graph; the store is Python that no
graph can hold: a slot cache and its policy, reads on worker threads, checksums, data-dependent
walks over the chosen experts. So, as expert parallelism's exchange (moekit.dist.graph_exchange),
each piece is a custom op that Dynamo leaves as a call and Inductor calls between its kernels (from
its C++ wrapper too), and whose fake says only the shape of what it returns:

  moekit::paged_experts(x, ids, weights, handle) → [B, D] like x
      one MoE layer's routed experts: its LayerStore's forward (misses, reads, cache policy and the
      combine, exactly the eager code), so the tokens and the cache statistics are the eager ones.
  moekit::prefetch_guess(x, handle) → x, unchanged (a copy)
      one prefetch guess (moekit.offload.prefetch): the coming layer's router on the residual, and
      the reads of what it points to started. It hands x back because the step must use what it
      returns: an op with no output that mutates nothing is dead code to the graph and is dropped,
      and using its output keeps it where the eager step calls it (before the attention or the
      experts it should run ahead of).

Eagerly the store and the guesses are called directly (each op's body, without the dispatcher's
~12 µs a call, measured: a paged step makes up to three such calls per layer).

An op's arguments are tensors and numbers, not Python objects: `handle` is a key into `_HELD`, a
table of weak references to the LayerStores and guesses that registered (one store per MoE layer of
each paged engine in this process, one guess per prefetched layer; one that is gone leaves the table
with it). A store in `scratch()` (the compiled step's warm-up, whose outputs are discarded) neither
reads nor counts anything: its op returns zeros, its guesses start nothing.

Legend: B rows of the step, D hidden, K experts per row.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from moekit.model.routing import RoutingDecision

_HELD: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def register(held) -> int:
    """A handle by which the ops find `held` (a moekit.offload.store.LayerStore, or a
    moekit.offload.prefetch.Guess)."""
    handle = next(_HANDLES)
    _HELD[handle] = held
    return handle


def _find(op: str, handle: int):
    held = _HELD.get(handle)
    if held is None:
        raise RuntimeError(f"moekit::{op}: nothing in this process has handle {handle}")
    return held


@torch.library.custom_op("moekit::paged_experts", mutates_args=())
def paged_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, handle: int) -> torch.Tensor:
    """x [B, D], ids [B, K] int64, weights [B, K] → Σ_k weights[b, k] · expert_{ids[b, k]}(x[b]), [B, D],
    with the experts' weights from the layer's store (LayerStore.forward)."""
    store = _find("paged_experts", handle)
    if store.discarding:
        return torch.zeros_like(x)
    return store.forward(store.experts, x, RoutingDecision(ids, weights))


@paged_experts.register_fake
def _(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("moekit::prefetch_guess", mutates_args=())
def prefetch_guess(x: torch.Tensor, handle: int) -> torch.Tensor:
    """x [B, D] (or [B, T, D]): the residual a guess reads → a copy of it; the guess's reads started."""
    _find("prefetch_guess", handle).guess(x)
    return x.clone()


@prefetch_guess.register_fake
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty_like(x)
