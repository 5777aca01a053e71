"""Serving from several ranks: rank 0 runs the server, the scheduler and the model; every rank runs
each MoE layer's expert exchange (layer.py) on the same tokens.

Rank 0 leads. At each MoE layer of each forward (a prefill or a decode step of the running batch)
it broadcasts an order, then the layer's input and routing:

    header [op, layer, T, K, x dtype, weights dtype] ─► x [T, D] ─► topk_ids [T, K] ─► topk_weights [T, K]

and every rank then calls the same ExpertParallelLayer.forward, so the exchange, its exactness and
its replica choice are those `moekit run --expert-parallel` has. The other ranks follow: they hold
their experts and no KV cache, wait for the next order and run it. They never see a request: the
step's composition (which rows, their K, their sampling) is decided on rank 0 and reaches them as
the routing it produced, so sampling, stop strings, cancellation and tiers need nothing from them.

An idle leader pings every `ping_s` so that a follower's bounded wait (the process group's
timeout, --ep-timeout) does not run out between requests. The first failed collective breaks the
leader for good: every later forward fails at once with the same line, naming the rank at fault
when it can be named (a self-launched rank that exited), instead of each row waiting the timeout.

Legend: T tokens of the forward, D hidden, K experts per token, E routed experts, R ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from moekit.dist.layer import ExchangeError, ExpertParallelLayer, _wire
from moekit.errors import MoekitError
from moekit.model.routing import RoutingDecision

FORWARD, PING, STOP, STATS, SWAP = 1, 2, 3, 4, 5
HEADER = 6
# What the bytes moved: hidden rows to the experts' ranks, their outputs back, the all-gather of the
# home chunks, and rank 0's broadcast of each MoE layer's tokens and routing.
KINDS = ("dispatch", "combine", "all_gather", "broadcast")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what travels, by index


@dataclass
class RankCounters:
    """One rank's exchange since start (a server runs for days: totals, not per-forward lists)."""

    rank: int
    forwards: int = 0  # MoE layer forwards run
    steps: int = 0  # model forwards (prefills and decode steps)
    exchange_seconds: float = 0.0  # in ExpertParallelLayer.forward: the collectives and the local experts
    sent_bytes: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))  # kind → bytes this rank sent
    received_bytes: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    served: dict = field(default_factory=dict)  # str(layer) → tokens each logical expert served here [E]
    loads: dict = field(default_factory=dict)  # str(layer) → (token, expert) pairs each rank computed [R]
    rss_bytes: Optional[int] = None
    weight_bytes: dict = field(default_factory=dict)  # "dense", "experts" → bytes this rank holds (rank_memory)

    def as_dict(self) -> dict:
        return dict(vars(self))


def served_here(topk_ids: np.ndarray, rank: int, layer: ExpertParallelLayer, forward: int) -> np.ndarray:
    """[E] tokens of this forward each logical expert computes on `rank` (its copy's share)."""
    t, k = topk_ids.shape
    experts = topk_ids.reshape(-1).astype(np.int64)
    owners = layer.table.owners(experts, np.arange(len(experts)) // k, forward)
    return np.bincount(experts[owners == rank], minlength=layer.table.count.shape[0])


def rank_loads(topk_ids: np.ndarray, ranks: int, layer: ExpertParallelLayer, forward: int) -> np.ndarray:
    """[R] pairs each rank computes in this forward: what the balancedness is taken over."""
    t, k = topk_ids.shape
    experts = topk_ids.reshape(-1).astype(np.int64)
    owners = layer.table.owners(experts, np.arange(len(experts)) // k, forward)
    return np.bincount(owners, minlength=ranks)


class CountedLayer:
    """An ExpertParallelLayer whose per-forward stats are folded into RankCounters and dropped."""

    def __init__(self, layer: ExpertParallelLayer, counters: RankCounters):
        self.layer, self.counters = layer, counters

    def forward(self, experts, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
        layer, c = self.layer, self.counters
        forward = layer.forwards
        ids = decision.topk_ids.cpu().numpy()
        started = time.perf_counter()
        out = layer.forward(experts, x, decision)
        c.exchange_seconds += time.perf_counter() - started
        s = layer.stats
        for kind, sent, received in (("dispatch", s.dispatch_bytes[-1], s.combine_bytes[-1]),  # rows in = outputs out
                                     ("combine", s.combine_bytes[-1], s.dispatch_bytes[-1]),
                                     ("all_gather", s.gather_bytes[-1], s.gather_bytes[-1])):  # chunks padded alike
            c.sent_bytes[kind] += sent
            c.received_bytes[kind] += received
        c.forwards += 1
        key = str(layer.layer)
        here = served_here(ids, layer.rank, layer, forward)
        c.served[key] = (np.asarray(c.served.get(key, 0)) + here).tolist()
        loads = rank_loads(ids, layer.ranks, layer, forward)
        c.loads[key] = (np.asarray(c.loads.get(key, 0)) + loads).tolist()
        layer.stats = type(s)()
        return out


def _broadcast(t: torch.Tensor) -> None:
    dist.broadcast(_wire(t), src=0)


def _failure(rank: int, what: str, err: BaseException, timeout_s: float) -> str:
    detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    return f"rank {rank}: expert-parallel {what} failed after at most {timeout_s:g}s: a peer rank died, hung or was stopped ({detail})"


class Leader:
    """Rank 0's side: installed as every MoE layer's `experts.store`, through `LeaderStore`."""

    def __init__(self, layers: dict, counters: RankCounters, world: int, timeout_s: float,
                 culprit: Optional[Callable[[], Optional[str]]] = None):
        """layers: MoE layer → CountedLayer; culprit(): a line naming a rank known to have failed
        (a self-launched rank that exited), or None."""
        self.layers, self.counters, self.world, self.timeout_s = layers, counters, world, timeout_s
        self.culprit = culprit
        self.broken: Optional[str] = None  # the first failure's line; every later order fails with it
        self.on_broken: Optional[Callable[[str], None]] = None
        self.last_order = time.monotonic()

    def _order(self, what: str, fn) -> None:
        if self.broken is not None:
            raise ExchangeError(self.broken)
        try:
            fn()
        except (RuntimeError, dist.DistError, ExchangeError) as err:
            self.fail(str(err) if isinstance(err, ExchangeError) else _failure(0, what, err, self.timeout_s))
            raise ExchangeError(self.broken) from None
        self.last_order = time.monotonic()

    def fail(self, message: str) -> None:
        """Break for good: the rank at fault named if it can be, else `message`."""
        if self.broken is not None:
            return
        named = self.culprit() if self.culprit is not None else None
        self.broken = named or message
        if self.on_broken is not None:
            self.on_broken(self.broken)

    def _header(self, op: int, layer: int = 0, tokens: int = 0, k: int = 0, x_dtype: int = 0, w_dtype: int = 0) -> None:
        _broadcast(torch.tensor([op, layer, tokens, k, x_dtype, w_dtype], dtype=torch.int64))

    def forward(self, index: int, experts, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
        """One MoE layer of rank 0's forward: order it, send its tokens and routing, run the exchange."""
        ids = decision.topk_ids.to(torch.int64).contiguous()  # [T, K]
        weights = decision.topk_weights.contiguous()  # [T, K]
        x = x.contiguous()  # [T, D]
        out: list = []

        def run() -> None:
            self._header(FORWARD, index, x.shape[0], ids.shape[1], DTYPES.index(x.dtype), DTYPES.index(weights.dtype))
            for t in (x, ids, weights):
                _broadcast(t)
            out.append(self.layers[index].forward(experts, x, RoutingDecision(ids, weights, decision.entropy)))

        self._order(f"layer {index} forward", run)
        sent = (x.numel() * x.element_size() + ids.numel() * 8 + weights.numel() * weights.element_size()) * (self.world - 1)
        self.counters.sent_bytes["broadcast"] += sent
        if index == min(self.layers):
            self.counters.steps += 1
        return out[0]

    def ping(self) -> None:
        """An idle server's sign of life, so the followers' bounded waits do not run out."""
        self._order("ping", lambda: self._header(PING))

    def gather(self) -> list[dict]:
        """Every rank's RankCounters (rank 0's own first)."""
        from moekit.dist.session import resident_bytes

        self.counters.rss_bytes = resident_bytes()
        everyone: list = [None] * self.world

        def run() -> None:
            self._header(STATS)
            dist.gather_object(self.counters.as_dict(), everyone, dst=0)

        self._order("stats gather", run)
        return everyone

    def stop(self) -> None:
        """Tell the followers to leave (a drained server); nothing to tell once broken."""
        if self.broken is None:
            self._order("stop", lambda: self._header(STOP))

    def swap(self, index: int, e: int, experts, weights: tuple) -> tuple:
        """Expert e of MoE layer `index` ← `weights` (prepared for rank 0's kernels) on every rank
        holding a copy, or on none (a rank that cannot take it says so before any rank changes).
        Between two steps. → the replaced weights, prepared for rank 0's kernels (for a rollback)."""
        hub = tuple(k.hub(w, n).contiguous() for k, w, n in zip(experts.kernels, weights, experts.in_features))
        out: list = []

        def run() -> None:
            self._header(SWAP, index, e, hub[0].shape[0], DTYPES.index(hub[0].dtype))
            for t in hub:
                _broadcast(t)
            out.append(_swap_here(self.layers[index].layer, e, experts, hub))

        self._order(f"swap of expert {e} at layer {index}", run)
        refused, old = out[0]
        if refused:
            raise MoekitError(refused)
        return tuple(k.prepare(w) for k, w in zip(experts.kernels, old))


def _swap_here(layer: ExpertParallelLayer, e: int, experts, hub: tuple) -> tuple[Optional[str], Optional[tuple]]:
    """This rank's part of a swap: vote, then (all for it) replace its copy, then the first holder's
    replaced weights (Hub layout) to rank 0. → (why it was refused, or None; the old weights on rank 0)."""
    holds = layer.weights is not None and e in layer.weights
    staged = tuple(k.prepare(w) for k, w in zip(experts.kernels, hub)) if holds else None
    refusal = None
    if layer.weights is None:
        refusal = f"rank {layer.rank} pages its experts (--expert-memory): hot swap needs them resident"
    elif holds and any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(staged, layer.weights[e])):
        refusal = f"rank {layer.rank}: the new weights of expert {e} are not laid out as its copy"
    votes = torch.zeros(layer.ranks, dtype=torch.int64)
    votes[layer.rank] = 0 if refusal is None else 1
    dist.all_reduce(votes)
    if votes.any():
        return f"the swap of expert {e} at layer {layer.layer} was refused, no rank changed: " + (
            refusal or f"rank {int(votes.nonzero()[0])} could not take it"), None
    old = None
    if holds:
        old = layer.weights[e]
        layer.weights[e] = staged
    first = int(layer.table.table[e, 0])  # the lowest rank holding a copy
    if first == layer.rank:
        old_hub = tuple(k.hub(w, n).contiguous() for k, w, n in zip(experts.kernels, old, experts.in_features))
        if layer.rank != 0:
            for t in old_hub:
                dist.send(_wire(t), dst=0)
        return None, old_hub
    if layer.rank == 0:
        old_hub = tuple(torch.empty_like(t) for t in hub)
        for t in old_hub:
            dist.recv(_wire(t), src=first)
        return None, old_hub
    return None, None


class LeaderStore:
    """What RoutedExperts calls on rank 0 for one MoE layer: its `store` hook for the forward, and
    the hot swap's way to every copy of an expert."""

    def __init__(self, leader: Leader, index: int, experts):
        from moekit.dist.graph_exchange import register

        self.leader, self.index, self.experts = leader, index, experts
        self.handle = register(self)  # how the compiled step's opaque op finds this layer

    def forward(self, experts, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
        return self.leader.forward(self.index, experts, x, decision)

    def decode(self, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
        """RoutedExperts.decode's form, in the compiled step: the exchange as one opaque op (graph_exchange)."""
        return torch.ops.moekit.ep_experts(x, decision.topk_ids, decision.topk_weights, self.handle)

    def replace_expert(self, e: int, weights: tuple) -> tuple:
        return self.leader.swap(self.index, e, self.experts, weights)


def _counters(sharded) -> RankCounters:
    from moekit.dist.rank_memory import weight_bytes

    return RankCounters(rank=sharded.me.rank, weight_bytes=weight_bytes(sharded.engine.decoder, sharded.layers))


def lead(sharded, timeout_s: float, culprit=None) -> Leader:
    """Rank 0: wrap a Sharded engine's EP layers so that every MoE forward is ordered to the others."""
    counters = _counters(sharded)
    layers = {i: CountedLayer(layer, counters) for i, layer in sharded.layers.items()}
    leader = Leader(layers, counters, sharded.me.world, timeout_s, culprit)
    for i in layers:
        experts = sharded.engine.decoder.layers[i].ffn.experts
        experts.store = LeaderStore(leader, i, experts)
    return leader


def follow(sharded) -> None:
    """A follower rank: run rank 0's orders until it says stop. A failed collective (rank 0 gone,
    hung or another follower dead) raises ExchangeError within the process group's timeout."""
    from moekit.dist.session import resident_bytes

    me = sharded.me
    counters = _counters(sharded)
    layers = {i: CountedLayer(layer, counters) for i, layer in sharded.layers.items()}
    experts = {i: sharded.engine.decoder.layers[i].ffn.experts for i in layers}
    dim = sharded.engine.spec.hidden_size
    header = torch.empty(HEADER, dtype=torch.int64)
    timeout = max(layer.layer.timeout_s for layer in layers.values())
    with torch.inference_mode():
        while True:
            try:
                _broadcast(header)
                op, index, tokens, k, x_dtype, w_dtype = header.tolist()
                if op == STOP:
                    return
                if op == STATS:
                    counters.rss_bytes = resident_bytes()
                    dist.gather_object(counters.as_dict(), None, dst=0)
                    continue
                if op == SWAP:  # header: [SWAP, layer, expert, gate_up rows, dtype]
                    ex = experts[index]
                    hub = tuple(torch.empty(shape, dtype=DTYPES[x_dtype]) for shape in ex.weight_shapes)
                    for t in hub:
                        _broadcast(t)
                    _swap_here(layers[index].layer, tokens, ex, hub)
                    continue
                if op != FORWARD:
                    continue  # a ping
                x = torch.empty((tokens, dim), dtype=DTYPES[x_dtype])
                ids = torch.empty((tokens, k), dtype=torch.int64)
                weights = torch.empty((tokens, k), dtype=DTYPES[w_dtype])
                for t in (x, ids, weights):
                    _broadcast(t)
            except (RuntimeError, dist.DistError) as err:
                raise ExchangeError(_failure(me.rank, "wait for rank 0's next order", err, timeout)) from None
            counters.received_bytes["broadcast"] += x.numel() * x.element_size() + ids.numel() * 8 + weights.numel() * weights.element_size()
            layers[index].forward(experts[index], x, RoutingDecision(ids, weights))
            if index == min(layers):
                counters.steps += 1


def start(job, me, compile: bool = False):
    """Join the ranks, load this rank's share of the checkpoint, and check that every rank loaded
    the same one with the same settings (a rank with other weights is refused here). → Sharded."""
    from moekit.dist.fingerprint import checkpoint_fingerprint
    from moekit.dist.group import join
    from moekit.dist.session import _agree, _request_key, load_sharded

    join(me, job.timeout_s, job.device)
    sharded = load_sharded(job, me, compile=compile)
    try:
        _agree(me, checkpoint_fingerprint(job.checkpoint), _request_key(job, []), None, job.timeout_s)
    except BaseException:
        sharded.engine.close()
        raise
    return sharded


def follower(job, me) -> None:
    """A follower rank's whole life in a server: start, follow until stopped, leave."""
    from moekit.dist.group import leave
    from moekit.dist.heartbeat import Beat

    from moekit.dist.rank_memory import keep_only_experts
    from moekit.dist.session import _rss

    try:
        sharded = start(job, me)
        keep_only_experts(sharded.engine.decoder, sharded.layers)
        sharded.rss_after_shard = _rss()  # the dropped weights handed back to the system
        beat = Beat(me, job.timeout_s).start()  # rank 0 names the rank whose beat stopped first
        try:
            follow(sharded)
        finally:
            beat.stop()
            sharded.engine.close()
    finally:
        leave()


def balancedness(loads: list[int]) -> Optional[float]:
    """mean ÷ max of the pairs each rank computed (1.0: perfectly even); None before any."""
    top = max(loads, default=0)
    return None if top == 0 else float(np.mean(loads) / top)

