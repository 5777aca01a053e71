"""Every figure of `moekit analyze` from one trace, as one JSON-ready dict."""

from __future__ import annotations

from moekit.analysis.activation import activation
from moekit.analysis.hitrate import hit_rate_curve
from moekit.analysis.load_stats import layer_stats, overall_stats, specialisation
from moekit.analysis.reuse_stats import coactivation, prefetch_headroom, reuse
from moekit.analysis.trace_data import RoutingTrace


def analyze(trace: RoutingTrace, params=None, hit_rate: bool = True) -> dict:
    layers = layer_stats(trace)
    return {
        "model": trace.model.to_json() if trace.model is not None else None,
        "entries": int(len(trace.layer)),
        "layers": layers,
        "overall": overall_stats(layers),
        "specialisation": specialisation(trace),
        "reuse": reuse(trace),
        "coactivation": coactivation(trace),
        "prefetch": prefetch_headroom(trace),
        "activation": activation(trace, params),
        "hit_rate": hit_rate_curve(trace) if hit_rate else None,
        "notes": list(trace.notes),
    }
