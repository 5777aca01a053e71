"""Per-token activation from a routing trace: distinct experts, active parameters and active share.

A token (row, position) sums its distinct experts over the MoE layers. Parameters follow the
engine's meter (moekit.engine.meter.params_per_token): embedding and head counted in full, so the
share is the calculator's. Without the model's counts the figures are experts per token and the
share of all routed experts, and say so.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from moekit.analysis.reuse_stats import token_keys
from moekit.analysis.trace_data import RoutingTrace

POSITION_BUCKETS = ((0, 16), (16, 64), (64, 256), (256, 1024), (1024, None))


def distribution(values: np.ndarray) -> Optional[dict]:
    if len(values) == 0:
        return None
    p5, p50, p95 = np.percentile(values, [5, 50, 95])
    return {"tokens": int(len(values)), "mean": float(values.mean()), "p5": float(p5), "p50": float(p50),
            "p95": float(p95), "min": float(values.min()), "max": float(values.max())}


def per_token(trace: RoutingTrace, params=None) -> dict[str, np.ndarray]:
    """Arrays over tokens: experts (distinct, all layers), share, active params (when `params`),
    and each token's domain and position."""
    keys = token_keys(trace)
    tokens, index = np.unique(keys, return_inverse=True)
    width = trace.width()
    experts = np.bincount(index, weights=width, minlength=len(tokens))
    out = {"experts": experts, "domain": np.empty(len(tokens), dtype=object), "position": np.zeros(len(tokens), int)}
    out["domain"][index] = trace.domain
    out["position"][index] = trace.position
    if params is None:
        out["share"] = experts / sum(trace.experts.values())
        return out
    active = np.full(len(tokens), float(params.active({})))
    for layer in trace.layers:
        sel = trace.layer == layer
        active += np.bincount(index[sel], weights=width[sel], minlength=len(tokens)) * params.expert_each.get(layer, 0)
    out["active_params"] = active
    out["share"] = active / params.total_params
    return out


def activation(trace: RoutingTrace, params=None) -> dict:
    tok = per_token(trace, params)
    share = tok["share"]
    by_position = {}
    for lo, hi in POSITION_BUCKETS:
        sel = (tok["position"] >= lo) & (tok["position"] < (hi if hi is not None else np.inf))
        if sel.any():
            by_position[f"{lo}-{hi - 1}" if hi is not None else f"{lo}+"] = distribution(share[sel])
    return {
        "share_of": "all parameters (embedding and head in full)" if params is not None else "routed experts only",
        "total_params": params.total_params if params is not None else None,
        "share": distribution(share),
        "active_params": distribution(tok["active_params"]) if params is not None else None,
        "experts_per_token": distribution(tok["experts"]),
        "by_domain": {d: distribution(share[tok["domain"] == d]) for d in trace.domains},
        "by_position": by_position,
    }
