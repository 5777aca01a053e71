"""Skewed routing for a random-weight checkpoint, in the benchmark harness only.

A checkpoint written with random weights routes uniformly (every expert equally likely: any
cache's worst case), and its greedy output repeats one token, so every decode step routes as the
one before (the best case). Neither is what a user's text does. `skew_routers` gives each MoE
layer's router a fixed logit bias, −s·ln(1 + rank), over a per-layer random order of its experts:
the probability of expert of rank r is multiplied by (1 + r)^−s (Zipf-like popularity, as trained
routers show), and sampling at a temperature (real_scale.py --temperature) varies the tokens, so
the decode's routing varies too. It changes the model's weights (a router bias), never moekit's
code; nothing in moekit imports it.

Measured, the bias alone is not enough: a random-weight model's hidden states share one direction,
so its tokens route nearly alike whatever they are (Qwen3-30B-A3B at 10 GiB, s = 0.4 and sampled
tokens: 95% decode hits). With real_scale.py's `--route-noise 1` (moekit's gumbel routing policy:
each token's experts drawn on their own) a numpy replay (top-8 of 128 on a fixed per-layer logit
of std 0.9 + this bias + Gumbel noise, LRU of 44 slots) gives 52% hits at s = 0, 60% at s = 0.5,
73% at s = 1: s = 0.5 is near the ~60% decode hit rate `moekit cache-sim` gives for the bundled
model's varied text at the same share (docs/BENCHMARKS.md, "Real size"). Run at that size with
`--route-noise 1 --route-skew 0.5`: 55% decode hits, the 10 GiB of experts full (docs/BENCHMARKS.md,
"Memory under every routing").
"""

from __future__ import annotations

import math

import torch


def zipf_bias(num_experts: int, s: float, seed: int) -> torch.Tensor:
    """[E] logit bias: −s·ln(1 + rank), the ranks a random order drawn from `seed`."""
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))
    bias = torch.empty(num_experts)
    bias[order] = torch.tensor([-s * math.log(1 + r) for r in range(num_experts)])
    return bias


def skew_routers(decoder, s: float) -> int:
    """Add zipf_bias(E, s, seed = layer index) to every MoE layer's router logits (on top of a bias
    the router may already have). Returns the number of routers changed."""
    from moekit.model.moe import MoE

    changed = 0
    for i, block in enumerate(decoder.layers):
        if not isinstance(block.ffn, MoE):
            continue
        router = block.ffn.router
        dtype = router.weight.dtype if router.weight.is_floating_point() else torch.float32  # q8_0 weights: fp32
        bias = zipf_bias(router.spec.num_experts, s, seed=i).to(dtype)
        if router.bias is not None:
            bias = bias + router.bias.detach()
        router.bias = torch.nn.Parameter(bias, requires_grad=False)
        changed += 1
    return changed
