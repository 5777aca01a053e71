"""Router health on /metrics: routing entropy per MoE layer over position, ITL jitter per request.

The entropy is what the scheduler tallies from its decode steps while the routers are watched
(engine/router_health.py; every server watches them, its decode step eager or compiled). The jitter index is std / mean of one request's
inter-token latencies; a request above JITTER_HIGH is counted as jittery.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moekit.engine.router_health import JITTER_HIGH, jitter_index

JITTER_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)


class EntropyCollector:
    def __init__(self, state):
        self.state = state  # moekit.serve.app.ServerState: its scheduler appears once loaded

    def collect(self):
        mean = GaugeMetricFamily("moekit:routing_entropy", "Mean routing entropy of decode tokens over E, divided by ln E, "
                                 "by MoE layer and position bucket (the bucket's first position).", labels=["layer", "position"])
        tokens = CounterMetricFamily("moekit:routing_entropy_tokens", "Decode tokens behind moekit:routing_entropy.",
                                     labels=["layer", "position"])
        scheduler = self.state.scheduler
        if scheduler is not None:
            for (layer, position), (value, n) in sorted(scheduler.entropy.snapshot().items()):
                mean.add_metric([str(layer), str(position)], value)
                tokens.add_metric([str(layer), str(position)], n)
        yield from (mean, tokens)


class JitterMetrics:
    def __init__(self, registry):
        self.index = Histogram("moekit:itl_jitter_index", "Std over mean of each request's inter-token latencies.",
                               ["tier"], buckets=JITTER_BUCKETS, registry=registry)
        self.high = Counter("moekit:itl_jitter_high", f"Requests whose ITL jitter index is above {JITTER_HIGH:g}.",
                            ["tier"], registry=registry)

    def observe(self, tier: str, token_times: list[float]) -> None:
        j = jitter_index(token_times)
        if j is None:
            return
        self.index.labels(tier=tier).observe(j)
        if j > JITTER_HIGH:
            self.high.labels(tier=tier).inc()
