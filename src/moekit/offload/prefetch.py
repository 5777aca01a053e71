"""Prefetch: guess a layer's experts from the residual stream before that layer gets there.

Two guesses per MoE layer l, both with layer l's OWN post-attention norm and router:
  early  from the residual between layer l-1's attention and its experts: the load overlaps
         layer l-1's experts and layer l's attention;
  late   from the residual entering layer l (after layer l-1's experts): closer, so righter, and
         still ahead of layer l's attention.
Each guess takes every token's top K + `extra` experts: the residual drifts a little per layer,
so the true choice is often just below the top K. On the first demo model (64 experts, K = 2),
measured over 5 domains × 32 greedy tokens: late top-K recall 68%, late top-(K+2) 81%, +4 90%;
early top-K 57%. Each LayerStore scores the union of its guesses against what it then needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moekit.model.moe import MoE
from moekit.offload import graph_store


def predict_experts(block, x: torch.Tensor, extra: int, limit: int) -> list[int]:
    """The distinct experts `block`'s router points to for x [B, T, D]: each token's top K + extra
    by router score, the most-pointed-to first when there are more than `limit`.

    A guess, so no family's exact selection (DeepSeek's groups) is replayed: the score order is
    the logits' (softmax is monotone) or, with a selection bias, sigmoid + bias."""
    moe: MoE = block.ffn
    flat = block.post_norm(x.reshape(-1, x.shape[-1]))  # [T, D]
    router = moe.router
    logits = router.logits(flat)  # [T, E]
    if router.selection_bias is not None:
        logits = logits.sigmoid() + router.selection_bias.float()
    width = min(router.spec.top_k + extra, logits.shape[1])
    ids = logits.topk(width, dim=-1).indices  # [T, K + extra]
    if ids.numel() <= limit:
        return sorted(set(ids.reshape(-1).tolist()))
    counts = torch.bincount(ids.reshape(-1), minlength=logits.shape[1])  # [E]
    top = torch.topk(counts, k=min(limit, int((counts > 0).sum()))).indices
    return sorted(int(e) for e in top)


def install_prefetch(decoder, stores: dict, extra: int, limit: int) -> None:
    """Hook the early and the late guess for every MoE layer after the first."""
    moe_layers = [i for i, b in enumerate(decoder.layers) if isinstance(b.ffn, MoE)]
    for previous, layer in zip(moe_layers, moe_layers[1:]):
        guess = Guess(decoder.layers[layer], stores[layer], extra, limit)
        decoder.layers[previous].before_ffn = guess  # early
        decoder.layers[layer].before_attn = guess  # late


def remove_prefetch(decoder) -> None:
    for block in decoder.layers:
        block.before_attn = block.before_ffn = None


@dataclass(eq=False)
class Guess:
    """One layer's guess as a Block hook: called with the residual, it starts the reads of the
    experts `block`'s router points to and hands the residual back. In the compiled step it is the
    opaque op moekit::prefetch_guess (moekit.offload.graph_store), whose output the step goes on with."""

    block: object  # the Block whose experts are guessed
    store: object  # its moekit.offload.store.LayerStore
    extra: int
    limit: int
    handle: int = field(init=False)
    opaque = True  # compiles: the decoder's step may call it (moekit.model.combinations)

    def __post_init__(self):
        self.handle = graph_store.register(self)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.moekit.prefetch_guess(x, self.handle)
        self.guess(x)
        return x

    def guess(self, x: torch.Tensor) -> None:
        if not self.store.discarding:
            self.store.prefetch(predict_experts(self.block, x, self.extra, self.limit))
