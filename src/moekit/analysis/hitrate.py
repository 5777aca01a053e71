"""The expert-cache hit-rate curve of a trace: hit rate against slots per layer, replayed through
moekit.analysis.cache_sim (the live store's SlotCache), for LRU and for Belady's bound."""

from __future__ import annotations

from moekit.analysis.trace_data import RoutingTrace
from moekit.analysis.cache_sim import simulate, trace_calls

CURVE_POLICIES = ("lru", "lfu", "belady")


def slot_counts(experts: int) -> list[int]:
    """1, 2, 4, ... up to every expert of a layer."""
    out, s = [], 1
    while s < experts:
        out.append(s)
        s *= 2
    return out + [experts]


def hit_rate_curve(trace: RoutingTrace, policies=CURVE_POLICIES) -> dict:
    calls = trace_calls(trace.table.select(["step", "row", "layer", "expert_ids"]))
    experts = max(trace.experts.values())
    slots = slot_counts(experts)
    curve = {p: [] for p in policies}
    for s in slots:
        for p in policies:
            total = simulate(calls, p, s).total()
            curve[p].append(total.hits / total.accesses if total.accesses else None)
    return {"slots": slots, "share": [s / experts for s in slots], "hit_rate": curve,
            "forwards": sum(len(c) for c in calls.calls.values())}
