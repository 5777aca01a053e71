"""The live expert store: each MoE layer's resident experts, loaded on demand, prefetched, accounted.

A LayerStore pairs a SlotCache (which experts are resident: the same bookkeeping cache-sim replays)
with the prepared weights themselves. A layer forward walks its needed experts in ascending id
order, as `SlotCache.call` does, so hits and misses match a simulation of the same trace; each
expert runs right after its access, so a prefill that needs more experts than there are slots can
evict experts it has finished with. The arithmetic is RoutedExperts.combine itself, the resident
engine's own code with the weights supplied from here, which keeps generation bit-identical.

Loads run on worker threads (pread + crc32 + cast + kernel layout release the GIL); the forward
waits only for the experts it needs now, and the wait is the stall time. With `read_ahead` R > 0 a
forward's misses are read in parallel and behind its compute: a forward whose experts fit beside
the pins (a token, a short prompt) starts every miss on the workers at once and runs each expert
as its read lands; a prompt that needs more experts than that keeps the reads of the next R
experts of the ascending walk under way while one runs. R = 0 reads each miss on the forward's
own thread, one after another (the plain reference: both give the same tokens, tests/offload). A failed load (checksum,
short read) leaves the expert out of the cache and fails the forward: wrong weights are never used.

Legend: T tokens, D hidden, E experts, K per token.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from moekit.model.routing import RoutingDecision
from moekit.offload import graph_store
from moekit.offload.slot_cache import SlotCache

Weights = tuple[Tensor, Tensor]  # prepared (gate_up, down) of one expert


@dataclass
class LayerStats:
    accesses: int = 0
    hits: int = 0  # resident when the forward asked (prefetched ones included)
    prefetch_hits: int = 0  # ... of which a prefetch brought in
    loads: int = 0  # experts read from disk (on demand or prefetched)
    disk_bytes: int = 0
    predicted: int = 0  # prefetch: experts predicted for this layer
    predicted_used: int = 0  # ... that the forward then needed
    needed_after_prediction: int = 0  # experts needed by forwards that had a prediction
    forwards: int = 0
    first_accesses: int = 0  # ... of the layer's first forward: the prompt pass (the prefill)
    first_hits: int = 0
    substituted: int = 0  # accesses served by the expert's stand-in (a miss, or its load still under way)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else float("nan")

    def as_dict(self) -> dict:
        precision = self.predicted_used / self.predicted if self.predicted else None
        recall = self.predicted_used / self.needed_after_prediction if self.needed_after_prediction else None
        decode = self.accesses - self.first_accesses
        return {
            "accesses": self.accesses,
            "hits": self.hits,
            "hit_rate": self.hit_rate if self.accesses else None,
            "decode_hit_rate": (self.hits - self.first_hits) / decode if decode else None,
            "prefetch_hits": self.prefetch_hits,
            "loads": self.loads,
            "disk_bytes": self.disk_bytes,
            "prefetch_precision": precision,
            "prefetch_recall": recall,
            "substituted": self.substituted,
        }


@dataclass
class StoreClock:
    """Process-wide figures of one store: stall time, resident experts and bytes, and their peaks.
    Bytes are each expert's own (a packed file may hold experts at several precisions).

    What the store holds is more than its resident experts: an expert evicted while the forward
    under way still runs it (a prompt whose experts outnumber the slots, read ahead) keeps its
    weights until that forward ends. `held_bytes` counts both, so its peak is every expert byte the
    store kept alive at once."""

    stall_s: float = 0.0
    resident_experts: int = 0
    peak_resident_experts: int = 0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    kept_bytes: int = 0  # evicted experts the forward under way still runs
    peak_held_bytes: int = 0  # resident + kept, at their highest

    @property
    def held_bytes(self) -> int:
        return self.resident_bytes + self.kept_bytes

    def hold(self, n: int, nbytes: int = 0) -> None:
        self.resident_experts += n
        self.peak_resident_experts = max(self.peak_resident_experts, self.resident_experts)
        self.resident_bytes += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def keep(self, nbytes: int) -> None:
        """nbytes of evicted experts stay alive until the forward ends (negative: it ended)."""
        self.kept_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)


class LayerStore:
    def __init__(
        self,
        layer: int,
        cache: SlotCache,
        # (layer, expert, spare weights to write into or None) → prepared weights; runs on a worker
        load: Callable[[int, int, Optional[Weights]], Weights],
        disk_bytes: Sequence[int],  # per expert: bytes its load reads
        memory_bytes: Sequence[int],  # per expert: bytes it holds once loaded
        pool: ThreadPoolExecutor,
        clock: StoreClock,
        retain: bool = True,  # False: the "no cache" baseline, every use reads the expert again
        slots: Sequence[Weights] = (),  # memory for the resident experts, loads write into it
        stand_ins: Sequence = (),  # per expert: a StandIn run while its full copy is not resident
        read_ahead: int = 0,  # misses read on workers ahead of the expert running (0: serial, inline)
        experts=None,  # the moekit.model.experts.RoutedExperts served (its combine runs the weights; decode)
    ):
        self.layer = layer
        self.experts = experts
        self.handle = graph_store.register(self)  # how the compiled step's opaque op finds this layer
        self.discarding = False  # in scratch(): steps whose outputs nobody reads
        self.retain = retain
        self.cache = cache
        self._load = load
        self._disk_bytes = disk_bytes
        self.memory_bytes = memory_bytes
        self._pool = pool
        self._clock = clock
        self._weights: dict[int, Future] = {}  # resident expert → its (maybe still loading) weights
        self._prefetched: set[int] = set()  # admitted by a prefetch and not yet used
        self._prediction: Optional[set[int]] = None
        self.stats = LayerStats()
        self.last_misses: set[int] = set()  # the experts the last forward had to read
        # Free slots, and the weights of evicted experts: the next load writes into one, so a miss
        # allocates nothing. An expert of the forward under way (_in_use) returns its weights only
        # when that forward ends (_deferred): a token's experts are all fetched before the first runs.
        self._spare: list[Weights] = list(slots)
        self._handed: dict[int, Optional[Weights]] = {}  # expert → the spare its load was given
        self._in_use: frozenset[int] = frozenset()
        self._deferred: list[tuple[Future, Optional[Weights]]] = []
        self._kept = 0  # bytes of this forward's evicted experts it still runs (StoreClock.keep)
        # Without slots (experts held as read: blocks, packed rows) a dropped expert is freed.
        self._slot_count = len(slots)
        self._slot_ptrs = frozenset(w[0].data_ptr() for w in slots)
        self.stand_ins = stand_ins
        self.read_ahead = read_ahead

    # --- residency -----------------------------------------------------------------------------

    def _start_load(self, e: int, background: bool = True) -> None:
        """Read expert e: on a worker (a prefetch, pins) or right here (the forward needs it now:
        handing it to a worker would only add a thread wake-up to the wait)."""
        self.stats.loads += 1
        self.stats.disk_bytes += self._disk_bytes[e]
        self._clock.hold(1, self.memory_bytes[e])
        into = self._spare.pop() if self._spare else None
        self._handed[e] = into
        if background:
            self._weights[e] = self._pool.submit(self._load, self.layer, e, into)
        else:
            self._weights[e] = self._inline(e, into)

    def _drop(self, e: Optional[int]) -> None:
        if e is None:
            return
        future = self._weights.pop(e, None)
        if future is not None:
            if e in self._in_use:  # the forward still runs it: its weights live until the forward ends
                self._clock.keep(self.memory_bytes[e])
                self._kept += self.memory_bytes[e]
            self._clock.hold(-1, -self.memory_bytes[e])
            handed = self._handed.pop(e, None)
            if self._slot_count and e in self._in_use:
                self._deferred.append((future, handed))
            elif self._slot_count:
                self._recycle(future, handed)
        self._prefetched.discard(e)

    def _recycle(self, future: Future, handed: Optional[Weights]) -> None:
        """A dropped expert's weights (or, if its load failed or never ran, the spare it was given)
        back to the spares, once no load writes into them any more."""

        def back(done: Future) -> None:
            ok = not done.cancelled() and done.exception() is None
            weights = done.result() if ok else handed
            if weights is None:
                return
            # A slot always comes back. Weights allocated while every slot was taken (a token
            # whose experts outnumber the slots pins leave) are kept only while fewer than the
            # slots are in use, so memory returns to the slots'.
            if weights[0].data_ptr() in self._slot_ptrs or len(self._spare) + len(self._weights) < self._slot_count:
                self._spare.append(weights)  # atomic under the GIL: a worker may run this

        if future.done():
            back(future)
        else:
            future.add_done_callback(back)

    def load_pinned(self) -> None:
        """Read the pinned experts now, at start, and wait for them (errors surface here)."""
        for e in sorted(self.cache.pinned):
            if e not in self._weights:
                self._start_load(e)
        for e in sorted(self.cache.pinned):
            self._result(e)

    def _result(self, e: int) -> Weights:
        future = self._weights[e]
        if future.done():
            return future.result()
        if future.cancel():
            # Still queued behind other guesses: read it here and now rather than wait for them.
            self._weights[e] = future = self._inline(e, self._handed.get(e))
            return future.result()
        return self._waited(future)

    def _waited(self, future: Future) -> Weights:
        """future's weights, the time spent waiting for its read counted as stall."""
        began = time.perf_counter()
        try:
            return future.result()
        finally:
            self._clock.stall_s += time.perf_counter() - began

    def _inline(self, e: int, into: Optional[Weights] = None) -> Future:
        """Load e on this thread into a finished Future (its error kept in it); the time is stall."""
        future: Future = Future()
        began = time.perf_counter()
        try:
            future.set_result(self._load(self.layer, e, into))
        except BaseException as err:  # kept in the future: _result raises it like a worker's
            future.set_exception(err)
        finally:
            self._clock.stall_s += time.perf_counter() - began
        return future

    def _account(self, e: int, access) -> None:
        """The SlotCache's access for e (hit or miss, and any victim) in the stats and the weights."""
        self.stats.accesses += 1
        if access.hit:
            self.stats.hits += 1
            if e in self._prefetched:
                self.stats.prefetch_hits += 1
        else:
            self.last_misses.add(e)  # this forward's misses: a batch charges each row its own
        self._prefetched.discard(e)
        self._drop(access.evicted)

    def _acquire(self, e: int, access) -> Weights:
        """Expert e's weights after the SlotCache's access for it, read here if missing."""
        self._account(e, access)
        if self.stand_ins and not (e in self._weights and self._weights[e].done()):
            # Substitution: never wait. The full copy loads behind; until it is in, the stand-in runs.
            if e not in self._weights:
                self._start_load(e, background=True)
            self.stats.substituted += 1
            return self.stand_ins[e]
        if e not in self._weights:
            self._start_load(e, background=False)
        return self._take(e)

    def _take(self, e: int) -> Weights:
        """Expert e's weights, waiting for (or, if still queued, doing) its load."""
        try:
            return self._result(e)
        except BaseException:
            # Never keep a failed load: the next request reads the expert again (and fails again
            # if the bytes are still wrong) instead of finding a broken entry.
            self._drop(e)
            self.cache.discard(e)
            raise

    def forget(self, e: int) -> None:
        """Expert e's weights changed where its loads read them (a hot swap, between two forwards):
        drop any copy held or loading, so its next use reads the new ones. A pinned expert stays
        pinned and is read again now, on a worker."""
        pinned = e in self.cache.pinned
        self._drop(e)
        if pinned:
            self._start_load(e)
        else:
            self.cache.discard(e)

    # --- prefetch ------------------------------------------------------------------------------

    def prefetch(self, predicted: list[int]) -> None:
        """Start loading the experts a prediction says the next forward of this layer will need."""
        # Guesses for one forward accumulate (early, then late) and are scored together.
        self._prediction = set(predicted) if self._prediction is None else self._prediction | set(predicted)
        for e in predicted:
            if e in self.cache.resident:
                continue
            evicted = self.cache.admit(e, protect=self._prediction)
            if e not in self.cache.resident:
                continue  # no room without evicting another predicted expert
            self._drop(evicted)
            self._prefetched.add(e)
            self._start_load(e)

    def _score_prediction(self, needed: list[int]) -> None:
        if self._prediction is None:
            return
        self.stats.predicted += len(self._prediction)
        self.stats.predicted_used += len(self._prediction.intersection(needed))
        self.stats.needed_after_prediction += len(needed)
        self._prediction = None

    # --- the forward ---------------------------------------------------------------------------

    def decode(self, x: Tensor, decision: RoutingDecision) -> Tensor:
        """RoutedExperts.decode's form (the Paged form calls it): forward, which the compiled step
        calls as one opaque op (moekit.offload.graph_store), x [B, D] → [B, D]."""
        if torch.compiler.is_compiling():
            return torch.ops.moekit.paged_experts(x, decision.topk_ids, decision.topk_weights, self.handle)
        return self.forward(self.experts, x, decision)

    @contextmanager
    def scratch(self) -> Iterator[None]:
        """Steps whose outputs are discarded (the compiled step's warm-up on a scratch cache): the
        compiled op reads nothing and counts nothing, so the cache and its statistics stay the
        eager run's."""
        self.discarding = True
        try:
            yield
        finally:
            self.discarding = False

    def forward(self, experts, x: Tensor, decision: RoutingDecision) -> Tensor:
        """What RoutedExperts.forward computes, with weights from this store. x [T, D] → [T, D]."""
        needed = sorted(set(decision.topk_ids.reshape(-1).tolist()))
        self._score_prediction(needed)
        self.last_misses = set()
        # One token fetches all its experts before the first runs; several run each as fetched.
        self._in_use = frozenset(needed) if x.shape[0] == 1 else frozenset()
        try:
            out = self._combine(experts, x, decision, needed)
        finally:
            self._in_use = frozenset()
            for future, handed in self._deferred:
                self._recycle(future, handed)
            self._deferred.clear()
            self._clock.keep(-self._kept)
            self._kept = 0
        if not self.retain:
            for e in sorted(self.cache.resident - self.cache.pinned):
                self._drop(e)
                self.cache.discard(e)
        if self.stats.forwards == 0:  # the prompt pass: decode_hit_rate leaves it out, as cache-sim does
            self.stats.first_accesses, self.stats.first_hits = self.stats.accesses, self.stats.hits
        self.stats.forwards += 1
        return out

    def _combine(self, experts, x: Tensor, decision: RoutingDecision, needed: list[int]) -> Tensor:
        walk = self.cache.forward(needed)  # the accesses cache-sim replays, in ascending ids
        fits = len(needed) <= self.cache.slots - len(self.cache.pinned)
        if self.read_ahead and not self.stand_ins:
            if fits:
                # Every victim is an expert outside the forward: all its misses can be read at once.
                return experts.combine(x, decision, self._all_started(walk))
            if x.shape[0] > 1:
                return experts.combine(x, decision, self._reading_ahead(walk))
        if x.shape[0] == 1:
            # RoutedExperts runs one token's experts in router order: take them all first (K fit
            # in the slots, and the walk protects the ones still to come).
            fetched = {e: self._acquire(e, access) for e, access in walk}
            return experts.combine(x, decision, fetched.__getitem__)

        # Several tokens: asked in ascending ids, each right before it runs, so a prefill that
        # needs more experts than there are slots may evict the ones it has finished with.
        def weights(e: int) -> Weights:
            taken, access = next(walk)
            assert taken == e, f"expert {e} asked, the walk is at {taken}"  # both ascend over `needed`
            return self._acquire(e, access)

        return experts.combine(x, decision, weights)

    def _all_started(self, walk) -> Callable[[int], Weights]:
        """A forward whose experts all fit beside the pins: every access made (the serial walk's
        own; none evicts another of the forward's experts), every miss's read started on the
        workers, and the weights taken as the combine asks for them, so expert k runs while k+1..
        are still being read. A read still queued when asked for is done here."""
        for e, access in walk:
            self._account(e, access)
            if e not in self._weights:
                self._start_load(e, background=True)
        return self._take

    def _reading_ahead(self, walk) -> Callable[[int], Weights]:
        """Several tokens whose experts outnumber the free slots (a long prompt): the walk advanced
        up to read_ahead experts beyond the one asked for, their reads started. An access may then
        evict an expert walked but not yet run; its weights are kept (held by `pending`, and its
        memory returned only when the forward ends, as a token's fetched experts are), so it runs
        on what was read for it. The accesses are the serial walk's, so are hits and loads."""
        pending: list[tuple[int, Future]] = []  # walked, not yet run: (expert, its weights)

        def weights(e: int) -> Weights:
            for taken, access in itertools.islice(walk, self.read_ahead + 1 - len(pending)):
                self._in_use = frozenset(p for p, _ in pending) | {taken}
                self._account(taken, access)
                if taken not in self._weights:
                    self._start_load(taken, background=True)
                pending.append((taken, self._weights[taken]))
            taken, future = pending.pop(0)
            assert taken == e, f"expert {e} asked, the walk is at {taken}"  # both ascend over `needed`
            if self._weights.get(e) is future:
                return self._take(e)
            return self._evicted_result(e, future)  # a later access of the walk evicted it

        return weights

    def _evicted_result(self, e: int, future: Future) -> Weights:
        """The weights read for e, which the walk evicted before e ran (its memory is deferred)."""
        if future.cancel():
            # Still queued: read it here into fresh memory (its spare went back with the drop).
            future = self._inline(e)
            if self._slot_count:
                self._deferred.append((future, None))
            return future.result()
        return self._waited(future)


@dataclass
class ExpertStore:
    """Every MoE layer's LayerStore, the worker pool and the figures `--json` reports."""

    layers: dict[int, LayerStore]
    pool: ThreadPoolExecutor
    clock: StoreClock
    expert_bytes: int  # one slot: the largest expert in memory (its precision, or the engine dtype)
    slots: int
    policy: str
    prefetch: bool
    pinned: dict[int, list[int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the user should know (clamps, caps)
    precision: str = ""  # what the experts are held as, e.g. "int8" or "128 bf16 + 384 int4"
    budget: Optional[int] = None  # --expert-memory in bytes, when less than every slot full of the largest expert
    substitute: str = ""  # "int4": every expert's stand-in resident (moekit.offload.substitute)
    substitute_bytes: int = 0  # what the stand-ins hold, beyond the budget
    overlay: Optional[object] = None  # moekit.offload.overlay.ExpertOverlay: hot-swapped experts' files
    slots_by_layer: Optional[dict[int, int]] = None  # --expert-split: each layer's slots (else `slots` each)

    def expert_nbytes(self, layer: int, e: int) -> int:
        """Bytes expert e of `layer` holds once loaded (what a token that uses it reads)."""
        return self.layers[layer].memory_bytes[e]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.overlay is not None:
            self.overlay.close()

    def stats(self) -> dict:
        per_layer = {str(l): s.stats.as_dict() for l, s in self.layers.items()}
        total = LayerStats()
        for s in self.layers.values():
            for name in vars(total):
                setattr(total, name, getattr(total, name) + getattr(s.stats, name))
        overall = total.as_dict()
        return {
            "policy": self.policy,
            "slots_per_layer": self.slots,  # the equal share (a split moves slots between layers, not their total)
            "slots_by_layer": {str(l): n for l, n in self.slots_by_layer.items()} if self.slots_by_layer else None,
            "prefetch": self.prefetch,
            "expert_bytes": self.expert_bytes,
            "expert_precision": self.precision,
            "budget_bytes": min(self.slots * self.expert_bytes * len(self.layers), self.budget or 1 << 62),
            "pinned": sum(len(v) for v in self.pinned.values()),
            # The names and meanings of cache-sim and `moekit run --json`: hit_rate counts every
            # forward, the prompt pass included; decode_hit_rate leaves each layer's first forward out.
            "hit_rate": overall["hit_rate"],
            "decode_hit_rate": overall["decode_hit_rate"],
            "accesses": overall["accesses"],
            "loads": overall["loads"],
            "disk_bytes": overall["disk_bytes"],
            "prefetch_precision": overall["prefetch_precision"],
            "prefetch_recall": overall["prefetch_recall"],
            "stall_s": self.clock.stall_s,
            "substitute": self.substitute or None,
            "substitute_bytes": self.substitute_bytes,
            "substituted": overall["substituted"],
            "peak_resident_expert_bytes": self.clock.peak_resident_bytes,
            # ... and with the evicted experts a forward still ran (a long prompt read ahead): every
            # expert byte the store kept alive at once; --expert-memory as given, to hold it against.
            "peak_held_expert_bytes": self.clock.peak_held_bytes,
            "expert_memory_bytes": self.budget,
            "layers": per_layer,
        }
