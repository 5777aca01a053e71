"""Expert load, router health and domain specialisation of a routing trace (numpy only).

Load counts a (token, expert) assignment once per distinct expert. Entropies are in bits.
Router health reads only what a trace records: each token's K combine weights (normalised to
shares), not the router's full distribution over E.

Verdict per layer: "collapsed" when the hottest 10% of experts serve at least half of the
assignments or at least half the experts are never used; "skewed" when the hottest 10% serve at
least a quarter or the busiest expert has 4× the mean load; "healthy" otherwise. A verdict needs a
sample: below 4 tokens per expert of the layer (VERDICT_TOKENS_PER_EXPERT) a few tokens would leave
most experts unused by chance, so the verdict is "too few tokens" and only the numbers stand.
"""

from __future__ import annotations

import math

import numpy as np

from moekit.analysis.trace_data import RoutingTrace

TOP1_CONFIDENT = 0.85  # the seeds' "downgrade to top-1 at confidence >= 0.85"
# Tokens per expert a layer needs before its load gets a verdict: at 4, a uniform router leaves an
# expert unused with probability about e^-4·K (under 2% at K = 1), so "unused" means something.
VERDICT_TOKENS_PER_EXPERT = 4
TOO_FEW = "too few tokens"
VERDICT_MEANINGS = ("collapsed: the hottest 10% of experts serve ≥ half the assignments, or ≥ half the experts "
                    "are unused; skewed: the hottest 10% serve ≥ a quarter, or one expert ≥ 4× the mean; healthy: "
                    "neither")


def entropy_bits(p: np.ndarray) -> float:
    p = np.asarray(p, dtype=np.float64)
    p = p[p > 0] / p.sum()
    return max(0.0, float(-(p * np.log2(p)).sum()))  # never -0.0


def js_bits(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen–Shannon divergence (bits: 0 = the same usage, 1 = disjoint experts)."""
    p, q = np.asarray(p, np.float64) / np.sum(p), np.asarray(q, np.float64) / np.sum(q)
    m = (p + q) / 2
    return entropy_bits(m) - (entropy_bits(p) + entropy_bits(q)) / 2


def expert_counts(trace: RoutingTrace, layer: int, mask=None) -> np.ndarray:
    """[E] tokens of `layer` (and `mask`) that chose each expert."""
    sel = trace.layer == layer if mask is None else (trace.layer == layer) & mask
    ids = trace.ids[sel]
    return np.bincount(ids[ids >= 0], minlength=trace.experts[layer]).astype(np.int64)


def load_of(counts: np.ndarray) -> dict:
    experts, total = len(counts), int(counts.sum())
    mean = total / experts
    hot = max(1, math.ceil(0.1 * experts))
    load_entropy = entropy_bits(counts) if total else 0.0
    return {
        "experts": experts,
        "assignments": total,
        "max_over_mean": float(counts.max() / mean) if total else None,
        "cv": float(counts.std() / mean) if total else None,
        "hot10_share": float(np.sort(counts)[::-1][:hot].sum() / total) if total else None,
        "unused": int((counts == 0).sum()),
        "load_entropy_bits": load_entropy,
        "load_entropy_max_bits": math.log2(experts),
    }


def verdict_min_tokens(experts: int) -> int:
    return VERDICT_TOKENS_PER_EXPERT * experts


def verdict(load: dict, tokens: int) -> str:
    if load["hot10_share"] is None:
        return "unused"
    if tokens < verdict_min_tokens(load["experts"]):
        return TOO_FEW
    if load["hot10_share"] >= 0.5 or load["unused"] * 2 >= load["experts"]:
        return "collapsed"
    if load["hot10_share"] >= 0.25 or load["max_over_mean"] >= 4:
        return "skewed"
    return "healthy"


def health_of(weights: np.ndarray) -> dict:
    """weights [n, K] (pads 0) → entropy of each token's shares and its top-1 share."""
    sums = weights.sum(axis=1, keepdims=True)
    shares = np.divide(weights, sums, out=np.zeros_like(weights), where=sums > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = 0.0 - np.where(shares > 0, shares * np.log2(shares), 0.0).sum(axis=1)  # 0.0, never -0.0
    top1 = shares[:, 0]
    hist, edges = np.histogram(top1, bins=20, range=(0.0, 1.0))
    return {
        "weight_entropy_bits": float(ent.mean()) if len(ent) else None,
        "top1_share_mean": float(top1.mean()) if len(top1) else None,
        "top1_confident_share": float((top1 >= TOP1_CONFIDENT).mean()) if len(top1) else None,
        "top1_histogram": {"edges": edges.tolist(), "counts": hist.tolist()},
    }


def layer_stats(trace: RoutingTrace) -> dict:
    out = {}
    for layer in trace.layers:
        counts = expert_counts(trace, layer)
        load = load_of(counts)
        tokens = int((trace.layer == layer).sum())
        out[str(layer)] = {
            "tokens": tokens,
            "counts": counts.tolist(),
            **load,
            **health_of(trace.weights[trace.layer == layer]),
            "verdict": verdict(load, tokens),
            "verdict_min_tokens": verdict_min_tokens(load["experts"]),
        }
    return out


def overall_stats(layers: dict) -> dict:
    """Means over layers, and the layers whose verdict is not healthy."""
    def mean(key):
        vals = [v[key] for v in layers.values() if v[key] is not None]
        return float(np.mean(vals)) if vals else None

    keys = ("max_over_mean", "cv", "hot10_share", "load_entropy_bits", "weight_entropy_bits", "top1_share_mean",
            "top1_confident_share")
    return {**{k: mean(k) for k in keys}, "unused": sum(v["unused"] for v in layers.values()),
            "unhealthy_layers": {l: v["verdict"] for l, v in layers.items() if v["verdict"] not in ("healthy", TOO_FEW)},
            "too_few_tokens_layers": [l for l, v in layers.items() if v["verdict"] == TOO_FEW]}


def specialisation(trace: RoutingTrace) -> dict:
    """Per-domain expert usage (shares per layer) and the JS divergence between domains, mean over layers."""
    domains = trace.domains
    usage = {}
    for d in domains:
        mask = trace.domain == d
        usage[d] = {str(l): (c / max(1, c.sum())).tolist() for l in trace.layers
                    for c in [expert_counts(trace, l, mask)]}
    divergence = {a: {b: float(np.mean([js_bits(usage[a][str(l)], usage[b][str(l)]) for l in trace.layers]))
                      for b in domains} for a in domains}
    tokens = {d: int(((trace.domain == d) & (trace.layer == trace.layers[0])).sum()) for d in domains}
    return {"domains": domains, "tokens": tokens, "usage": usage, "js_bits": divergence}
