"""Prometheus metrics, named in the `moekit:` namespace after vLLM's where vLLM has one.

One registry per server (no process-global state). Latencies are histograms labelled by tier;
what the scheduler already counts (rows running and waiting, tokens per (layer, expert), the
expert cache) is read from it at scrape time by a collector instead of being copied every step.
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets for the latencies, shortened at the long end for a CPU engine.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
SHARE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class SchedulerCollector:
    """Gauges and counters the scheduler keeps itself, read when Prometheus scrapes."""

    def __init__(self, state):
        self.state = state  # moekit.serve.app.ServerState: its scheduler appears once loaded

    def collect(self):
        scheduler = self.state.scheduler
        running = GaugeMetricFamily("moekit:num_requests_running", "Requests in the running batch.")
        waiting = GaugeMetricFamily("moekit:num_requests_waiting", "Requests waiting for a row, by tier.", labels=["tier"])
        tokens = CounterMetricFamily(
            "moekit:expert_tokens", "Tokens routed to each expert (prompt and generated; a prompt prefix found in the "
            "prefix cache is not routed again, so not counted again).", labels=["layer", "expert"]
        )
        imbalance = GaugeMetricFamily(
            "moekit:expert_load_imbalance", "Max over mean of the tokens per expert since start, per MoE layer.", labels=["layer"]
        )
        if scheduler is not None:
            running.add_metric([], scheduler.num_running)
            for tier, n in scheduler.waiting_by_tier().items():
                waiting.add_metric([tier], n)
            for layer, counts in scheduler.expert_tokens.items():
                snapshot = list(counts)
                for expert, n in enumerate(snapshot):
                    tokens.add_metric([str(layer), str(expert)], n)
                mean = sum(snapshot) / len(snapshot) if snapshot else 0.0
                imbalance.add_metric([str(layer)], max(snapshot) / mean if mean else 0.0)
        yield from (running, waiting, tokens, imbalance)
        if scheduler is not None:
            yield from policy_counters(scheduler.policy_stats)
        prefix = scheduler.prefix_cache if scheduler is not None else None
        if prefix is not None:
            queries = CounterMetricFamily("moekit:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
            hits = CounterMetricFamily("moekit:prefix_cache_hits", "Prompt tokens whose KV the prefix cache held.")
            queries.add_metric([], prefix.queried_tokens)
            hits.add_metric([], prefix.hit_tokens)
            yield from (queries, hits)
        store = scheduler.store if scheduler is not None else None
        if store is not None:
            stats = [layer.stats for layer in store.layers.values()]
            hits = CounterMetricFamily("moekit:expert_cache_hits", "Expert-cache accesses that found the expert resident.")
            misses = CounterMetricFamily("moekit:expert_cache_misses", "Expert-cache accesses that read the expert from disk.")
            hits.add_metric([], sum(s.hits for s in stats))
            misses.add_metric([], sum(s.accesses - s.hits for s in stats))
            yield from (hits, misses)


# PolicyStats field → (counter name, help): the load-control and router-cache counters of the
# routing policies requests run (moekit.model.routing.PolicyStats says what each counts).
POLICY_COUNTERS = {
    "routed": ("moekit:routing_decisions", "Token x layer routing decisions made by a routing policy."),
    "overflow": ("moekit:routing_overflow", "Assignments beyond an expert's capacity in their step (capacity, loadaware)."),
    "dropped": ("moekit:routing_dropped", "Overflowing assignments dropped (given weight 0)."),
    "rerouted": ("moekit:routing_rerouted", "Overflowing assignments moved to the token's next choice with room."),
    "penalised": ("moekit:routing_penalised", "Assignments loadaware's overload penalty moved off exact routing's expert."),
    "cache_lookups": ("moekit:routing_cache_lookups", "Router decision cache (cache:N) lookups."),
    "cache_hits": ("moekit:routing_cache_hits", "Router decision cache lookups that reused a cached decision."),
    "resets": ("moekit:routing_resets", "Times reset:N cleared a layer's policy state."),
}


def policy_counters(ledgers: dict):
    """ledgers: policy text → {layer: PolicyStats} (the scheduler's) → one counter family per field,
    labelled by policy and layer."""
    families = {field: CounterMetricFamily(name, text, labels=["policy", "layer"])
                for field, (name, text) in POLICY_COUNTERS.items()}
    for policy, layers in list(ledgers.items()):
        for layer, stats in sorted(list(layers.items())):
            for field, family in families.items():
                family.add_metric([policy, str(layer)], getattr(stats, field))
    return families.values()


class ServerMetrics:
    def __init__(self, state):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "moekit:time_to_first_token_seconds", "Time to first token.", ["tier"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "moekit:inter_token_latency_seconds", "Time between two generated tokens.", ["tier"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "moekit:e2e_request_latency_seconds", "Arrival to last token.", ["tier"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "moekit:request_queue_time_seconds", "Arrival to admission into the batch.", ["tier"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.first_token_stages = Histogram(
            "moekit:first_token_stage_seconds", "Where a request's time to its first token went: parse (HTTP "
            "arrival to queued), queue (to admitted), prefill (to its first token sampled), stream (to that "
            "token's frame written; streamed requests only).", ["tier", "stage"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("moekit:prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("moekit:generation_tokens", "Tokens generated.", registry=r)
        self.weight_bytes = Counter(
            "moekit:generation_weight_bytes", "Weight bytes the passes that made the generated tokens read "
            "(each routed expert at the bytes it holds: int8, MXFP4, FP8 or a paged precision).", registry=r
        )
        self.success = Counter("moekit:request_success", "Requests finished, by reason.", ["finished_reason"], registry=r)
        self.failures = Counter("moekit:request_failure", "Requests that failed inside the engine.", registry=r)
        self.active_share = Histogram(
            "moekit:active_share_per_token", "Share of the model's parameters each generated token used.", buckets=SHARE_BUCKETS, registry=r
        )
        self.batch = Histogram("moekit:batch_size_per_step", "Rows in each decode step.", buckets=BATCH_BUCKETS, registry=r)
        r.register(SchedulerCollector(state))

    def observe_request(self, tier: str, outcome, token_times: list[float], reason: str, total_params: int,
                        arrived: Optional[float] = None, first_sent: Optional[float] = None) -> None:
        """A finished request: its latencies (from the scheduler's clock), tokens and share per token.
        arrived: when its HTTP request reached the route; first_sent: when its first token's frame
        was written (time.perf_counter() readings, the scheduler's clock)."""
        if outcome.finish_reason == "error":
            self.failures.inc()
            return
        self.success.labels(finished_reason=reason).inc()
        self.queue.labels(tier=tier).observe(max(outcome.admitted_at - outcome.submitted_at, 0.0))
        if token_times:
            self.ttft.labels(tier=tier).observe(token_times[0] - outcome.submitted_at)
            for stage, seconds in first_token_stages(outcome, token_times[0], arrived, first_sent).items():
                self.first_token_stages.labels(tier=tier, stage=stage).observe(seconds)
            itl = self.itl.labels(tier=tier)
            for before, after in zip(token_times, token_times[1:]):
                itl.observe(after - before)
            self.e2e.labels(tier=tier).observe(token_times[-1] - outcome.submitted_at)
        self.generation_tokens.inc(len(outcome.token_ids))
        self.weight_bytes.inc(outcome.usage.bytes_read_per_token * outcome.usage.generated_tokens)
        for active in outcome.active_params:
            self.active_share.observe(active / total_params)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def first_token_stages(outcome, first_token: float, arrived: Optional[float], first_sent: Optional[float]) -> dict[str, float]:
    """A request's time to first token, stage by stage (seconds; the stages whose ends are known)."""
    stages = {"queue": outcome.admitted_at - outcome.submitted_at, "prefill": first_token - outcome.admitted_at}
    if arrived is not None:
        stages["parse"] = outcome.submitted_at - arrived
    if first_sent is not None:
        stages["stream"] = first_sent - first_token
    return {stage: max(seconds, 0.0) for stage, seconds in stages.items()}
