"""Continuous (iteration-level) batching: requests join and leave a running decode batch every step.

The scheduler owns `max_batch` rows of one preallocated KV cache. Each step it
  1. lets go of rows that finished, were cancelled or failed, moving the last running row into
     each freed one, so the running rows are always 0..n-1 and their cache is a view, never gathered;
  2. admits waiting requests into free rows, tier S before A before B, and within a tier the lowest
     `priority` first (vLLM's convention), then in order of arrival: each is prefilled as a lone
     `generate` prefills it (after the blocks of its prompt found in the prefix cache, if any:
     moekit.engine.prefix_cache), and its cache copied into its row. A step prefills at most
     `prefill_tokens` prompt tokens: a longer prompt is prefilled in chunks of that many, one per
     step, each after the KV of the chunks before it (chunked prefill, vLLM's
     max_num_batched_tokens), so an arriving long prompt does not stall the running rows' decode.
     When no row was running, requests that arrive while the step prefills are admitted too,
     before its decode, within what is left of the budget (a burst's late part then starts in its
     first part's step);
  3. runs one decode step over every running row (Decoder.forward_rows): each row at its own
     length and RoPE position, with its own K; an expert chosen by any row is read once. The
     step's chunk of a long prompt rides in that forward where it can (Decoder.forward_mixed,
     vLLM's mixed batch: the rows' tokens and the chunk's in one compiled graph, so the experts
     both read are read once; the chunk then at most MIXED_TOKENS less the rows, as vLLM counts
     decode tokens in a step's budget), else it runs as a forward of its own just before it.
Sampling is per row, with the request's own settings and seed, so a greedy or seeded request gets
what it gets alone. Requests admitted together with the same prompt and K (a request's `n`
continuations) share one prefill, its cache copied into each of their rows. The scheduler knows no HTTP: a request hears of its tokens and its end through
its callbacks, which run on the scheduler's thread and must return quickly.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from contextlib import nullcontext
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import repeat
from typing import Callable, Optional, Sequence

import torch

from moekit.engine.constraints import ConstraintError, TokenConstraint, mask_logits
from moekit.engine.generate import check_request, left_pad
from moekit.engine.logprobs import MAX_TOP, TokenLogprob, chosen_logprobs, prompt_logprobs
from moekit.engine.meter import (ExpertBytes, ParamsPerToken, WorkDone, params_per_token, pass_bytes, pass_bytes_around,
                                 work_done)
from moekit.engine.prefix_cache import Block, PrefixCache, read_slots, routing_rows, write_slots
from moekit.engine.router_health import EntropyTally
from moekit.engine.row_routing import RowRouting
from moekit.engine.sampling import (SamplingParams, check_sampling, greedy as greedy_tokens, make_generator,
                                    next_tokens)
from moekit.engine.waiting import WaitingQueue
from moekit.errors import MoekitError
from moekit.model.cache import copy_row
from moekit.model.decoder import StepChoices
from moekit.model.routing import PolicyRun, PolicyStats, RoutingDecision
from moekit.model.routing_policies import is_batch_level, policy_width

TIERS = ("S", "A", "B")  # admitted in this order
# Distinct (layer, experts used) counts whose token cost the scheduler keeps: a few per K in use;
# per-layer policies can make many, and past this they are computed each time.
TOKEN_COSTS_KEPT = 4096
# Rows of a mixed step (decode rows + the chunk riding with them), as vLLM counts decode tokens in a
# step's budget: the chunk takes what the rows leave, at least MIXED_FLOOR tokens. Why so few: a chunk's
# tokens are compute, ~0.37 ms each in the mixed step on the ~140M qwen3_moe fp32 at 2 threads, where
# the decode of 15 rows took ~20-25 ms (benchmarks/mixed_step_ab.py), so a 128-token chunk made its
# step ~3x a plain one, mixed or not. Served at c = 16 with 512-token prompts arriving (docs/BENCHMARKS.md
# "Mixed steps"): ITL p99 / p50 at 32 1.91-1.97x quiet (48: 2.29-2.48x quiet, median 2.06x under load;
# 64: 2.22x; 3.11x before the mixed step); each arrival's own TTFT p50 1.1-1.7 s at 32, 1.3 s at 48,
# 0.4 s before. Short prompts are admitted within prefill_tokens as before (the level without
# arrivals is unchanged).
MIXED_TOKENS = 32
MIXED_FLOOR = 16


def tier_top_k(tier: str, model_k: int) -> int:
    """Experts per token of a tier: S the model's own K, A half of it (rounded up), B one."""
    if tier == "S":
        return model_k
    if tier == "A":
        return math.ceil(model_k / 2)
    if tier == "B":
        return 1
    raise MoekitError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")


class QueueFull(MoekitError):
    """A tier's waiting queue is at its limit (a server answers 429)."""


@dataclass
class MoeUsage:
    """What one request's tokens touched, metered from its own routing (prompt included in
    `experts_touched`, since those experts had to be read too; a prompt prefix found in the prefix
    cache counts with the routing its tokens had when they were computed, kept beside their KV)."""

    top_k: int
    tier: str
    generated_tokens: int
    active_params_per_token: float  # mean over generated tokens, embedding and head in full
    active_share: float  # active_params_per_token / total parameters
    bytes_read_per_token: float  # mean bytes a generated token's pass read (one embedding row)
    experts_touched: int  # distinct (layer, expert) pairs
    cache_hits: Optional[int] = None  # expert-cache hits and misses of this request's experts,
    cache_misses: Optional[int] = None  # when experts are paged
    routing: Optional[str] = None  # the request's routing policy; None: the family's, at top_k
    work: WorkDone = field(default_factory=WorkDone)  # expert bytes and FLOPs, prompt and generated

    def as_dict(self) -> dict:
        out = {
            "active_share": self.active_share,
            "active_params_per_token": self.active_params_per_token,
            "experts_touched": self.experts_touched,
            "top_k": self.top_k,
            "tier": self.tier,
            "bytes_read_per_token": self.bytes_read_per_token,
        }
        if self.cache_hits is not None:
            out["expert_cache"] = {"hits": self.cache_hits, "misses": self.cache_misses}
        if self.routing is not None:
            out["routing"] = self.routing
        out.update(self.work.as_dict())
        return out


@dataclass
class Outcome:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token), "length", "cancelled" or "error"
    usage: MoeUsage
    error: Optional[str] = None
    active_params: list[int] = field(default_factory=list)  # per generated token
    submitted_at: float = 0.0  # time.perf_counter() readings
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass(eq=False)
class Request:
    prompt: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    tier: str = "S"
    top_k: Optional[int] = None  # experts per token; None: the tier's
    constraint: Optional[TokenConstraint] = None  # a grammar its tokens must follow (engine/constraints.py)
    routing: Optional[object] = None  # a moekit.model.routing policy; None: exact at top_k
    canary: bool = False  # runs on the canary weights while a canary is on (moekit.serve.canary)
    on_token: Optional[Callable[[int], None]] = None  # each new token id
    on_finish: Optional[Callable[[Outcome], None]] = None
    logprobs: Optional[int] = None  # each generated token's logprob and this many top ones (None: none)
    on_logprob: Optional[Callable[[TokenLogprob], None]] = None  # called just before on_token
    prompt_logprobs: Optional[int] = None  # the prompt's tokens' logprobs (echo), this many top ones
    on_prompt_logprobs: Optional[Callable[[list], None]] = None  # once, after the prefill
    # Set by the client once it has passed the first token on (a server: its frame written); the decode step
    # after the one that made it waits for that, briefly (Scheduler's first_token_wait_s). None: no wait.
    first_passed: Optional[threading.Event] = None
    cancelled: bool = False  # set by Scheduler.cancel; the row leaves at the next step
    submitted_at: float = 0.0
    priority: int = 0  # within its tier, lower is admitted first (vLLM's convention)
    finished: bool = False  # on_finish has been called (it is called once)


@dataclass(eq=False)
class _Row:
    """A running request: its cache row's length, its sampler and its meter."""

    request: Request
    top_k: int
    generator: Optional[torch.Generator]
    length: int  # slots written in its cache row
    cached: int = 0  # prompt tokens taken from the prefix cache
    tokens: list[int] = field(default_factory=list)
    touched: set = field(default_factory=set)  # (layer, expert)
    active: list[int] = field(default_factory=list)  # active params of each generated token
    bytes_sum: int = 0
    work: WorkDone = field(default_factory=WorkDone)
    run: Optional[PolicyRun] = None  # the request's routing policy with its own state
    hits: int = 0
    misses: int = 0
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    finish: Optional[str] = None
    error: Optional[str] = None
    # (layers, count): the prompt's routing, metered once its first token has gone out (Scheduler._meter_held)
    unmetered: Optional[tuple[list, bool]] = None


@dataclass(eq=False)
class _Fill:
    """A prompt being prefilled into a cache of its own, a chunk per call, for `rows` (requests with
    this prompt and K): its first `done` tokens' KV are in `cache` (a cached prefix's included)."""

    rows: list[_Row]
    keys: list[bytes]  # the prompt's block keys in the prefix cache (none without one)
    cached: int  # prompt tokens whose KV came from the prefix cache
    cache: object  # a moekit.model.cache.KVCache of one row, the prompt's length
    done: int
    decisions: list = field(default_factory=list)  # per chunk computed: [(layer, RoutingDecision)]
    logits: list = field(default_factory=list)  # per chunk: [T_chunk, V] when scoring the prompt, else its last [1, V]

    @property
    def head(self) -> _Row:
        return self.rows[0]

    @property
    def left(self) -> int:
        return self.head.length - self.done


@dataclass
class StepStats:
    """What one scheduler step did, for metrics."""

    batch: int  # rows in the decode step (0: prefills only)
    admitted: int
    seconds: float


class Scheduler:
    def __init__(
        self,
        decoder,
        max_batch: int = 16,
        max_len: Optional[int] = None,
        bytes_per_param: int = 4,
        expert_bytes: Optional[ExpertBytes] = None,
        dense_saving: int = 0,
        queue_limit: int = 256,
        store=None,
        on_step: Optional[Callable[[StepStats], None]] = None,
        prefill_tokens: int = 2048,
        prefix_cache: Optional[PrefixCache] = None,
        first_token_wait_s: float = 0.0,
    ):
        """max_len: slots per row (prompt + generated), at most the model's context.
        bytes_per_param, expert_bytes, dense_saving: what the usage meter counts a weight and each
        routed expert at, and what int8 projections save (the engine's: Engine.bytes_per_param,
        .expert_bytes and .dense_saving, so that a request's bytes per token are what `moekit run`
        meters for it).
        queue_limit: waiting requests per tier before submit refuses (QueueFull).
        prefill_tokens: prompt tokens one step may prefill (padded, when several prompts are
        prefilled together: a burst of arrivals is one forward instead of one after another); a
        prompt longer than this is prefilled in chunks of this many tokens, one per step, between
        the running rows' decode steps (chunked prefill).
        prefix_cache: where prompt prefixes' KV is kept across requests (None: none is).
        first_token_wait_s: after a step's prefills gave requests their first tokens, how long at most
        its decode waits for those requests' `first_passed` events (all of them together). A server's
        event loop writes a first token's frame while this thread sleeps, instead of while the decode's
        threads hold every core (two here): the first token's way out is part of its TTFT, the decode's
        delay is the loop's own work, done either way."""
        spec = decoder.spec
        if max_batch < 1:
            raise MoekitError(f"max-batch must be at least 1, got {max_batch}")
        self.decoder = decoder
        self.spec = spec
        self.max_batch = max_batch
        self.max_len = min(max_len or spec.max_position_embeddings, spec.max_position_embeddings)
        self.bytes_per_param = bytes_per_param
        self.expert_bytes = expert_bytes
        self.dense_saving = dense_saving
        self.queue_limit = queue_limit
        if prefill_tokens < 1:
            raise MoekitError(f"max-prefill-tokens must be at least 1, got {prefill_tokens}")
        self.prefill_tokens = prefill_tokens
        self.store = store
        self.prefix_cache = prefix_cache
        self.on_step = on_step
        self.counts: ParamsPerToken = params_per_token(spec)
        self._token_costs: dict[tuple, tuple[WorkDone, int, int]] = {}  # see _token_cost
        self.model_k = max(self.counts.top_k.values(), default=0)
        self.moe_layers = sorted(self.counts.top_k)
        experts = max((spec.layers[l].ffn.num_experts for l in self.moe_layers), default=0)
        # What a policy may widen a token to (topk:k up to E): the fewest routed experts of any MoE layer.
        self.num_experts = min((spec.layers[l].ffn.num_experts for l in self.moe_layers), default=0)
        # Routing policies' counters (overflow, drops, cache hits, ...) per policy, per layer, over
        # every request's run: /metrics reads them. A batch-level policy's rows share one run.
        self.policy_stats: dict[str, dict[int, PolicyStats]] = {}
        # Tokens routed to each (layer, expert) since start: Prometheus reads it at scrape time.
        self.expert_tokens = {l: [0] * experts for l in self.moe_layers}
        # Routing entropy of decode steps by layer and position, when the routers are watched.
        self.entropy = EntropyTally({l: spec.layers[l].ffn.num_experts for l in self.moe_layers})
        # While a hot swap's canary runs: an object whose applied() puts the canary weights in for a
        # with-block (moekit.serve.canary.Canary); set and cleared between steps.
        self.canary = None
        self.cache = decoder.new_cache(max_batch, self.max_len)
        self.device = self.cache.key_mask.device
        self.rows: list[_Row] = []
        self.waiting = {tier: WaitingQueue() for tier in TIERS}
        self._admitting: list[Request] = []  # off the queue, not yet running: abort_all ends them too
        self._fill: Optional[_Fill] = None  # the prompt being prefilled in chunks, one per step
        # Tokens of _fill's next chunk, taken from this step's budget, to run in its decode's forward
        # (a mixed step: moekit.model.mixed_step) or, where that does not run, alone before it.
        self._riding: Optional[int] = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._between: deque = deque()  # (callable, Future): run on this thread between two steps
        self.first_token_wait_s = first_token_wait_s
        self._first_passed: list[threading.Event] = []  # of the first tokens made since the last wait (_let_first_tokens_out)

    # ---- the client side (any thread) ----

    def check(self, request: Request) -> None:
        """Refuse what cannot run, before it is queued: one line naming the problem."""
        # max_new_tokens 0 only scores the prompt (echo with prompt logprobs, as lm-eval asks).
        scoring = request.max_new_tokens == 0 and request.prompt_logprobs is not None
        check_request([request.prompt], max(request.max_new_tokens, 1) if scoring else request.max_new_tokens,
                      self.spec.vocab_size, self.max_len)
        check_sampling(request.sampling)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(request, name)
            if value is not None and not 0 <= value <= MAX_TOP:
                raise MoekitError(f"{name} must be between 0 and {MAX_TOP}, got {value}")
        tier_top_k(request.tier, self.model_k or 1)
        if request.top_k is not None and self.model_k and not 1 <= request.top_k <= self.model_k:
            raise MoekitError(f"top_k must be between 1 and the model's {self.model_k}, got {request.top_k}")

    def submit(self, request: Request) -> Request:
        self.submit_all([request])
        return request

    def submit_all(self, requests: Sequence[Request]) -> None:
        """Queue all of them or none (one HTTP request's prompts and `n` continuations): submitted
        together, a request's continuations are admitted together and share their prefill."""
        for request in requests:
            self.check(request)
        now = time.perf_counter()
        with self._lock:
            for tier in TIERS:
                adding = sum(r.tier == tier for r in requests)
                if adding and len(self.waiting[tier]) + adding > self.queue_limit:
                    raise QueueFull(f"the tier {tier} queue is full ({self.queue_limit} waiting); retry later")
            for request in requests:
                request.submitted_at = now
                self.waiting[request.tier].append(request)
        self._wake.set()

    def cancel(self, request: Request) -> None:
        """The request leaves at the next step (a client that went away)."""
        request.cancelled = True
        self._wake.set()

    def between_steps(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the scheduler's thread before the next step (never inside one): a change of
        weights made there is seen by whole steps only. The Future holds fn's result or error."""
        future: Future = Future()
        with self._lock:
            self._between.append((fn, future))
        self._wake.set()
        return future

    def in_flight(self) -> list[int]:
        """Tokens generated so far by each running row (what a change between steps splits)."""
        return [len(row.tokens) for row in self.rows]

    def _run_between(self) -> None:
        while True:
            with self._lock:
                if not self._between:
                    return
                fn, future = self._between.popleft()
            try:
                future.set_result(fn())
            except Exception as err:  # noqa: BLE001 - the caller gets it through the Future
                future.set_exception(err)
            if self.prefix_cache is not None:
                self.prefix_cache.clear()  # what runs here may change weights: cached KV is stale
            if self._fill is not None:
                # Its chunks so far ran on the weights before: it starts again, uncached.
                self._fill = self._start_fill(self._fill.rows, self._fill.keys, (), chunked=True)

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def waiting_by_tier(self) -> dict[str, int]:
        return {tier: len(q) for tier, q in self.waiting.items()}

    def run(self, stop: threading.Event, idle_wait_s: float = 0.05) -> None:
        """Step until `stop` is set; sleep while there is nothing to do."""
        while not stop.is_set():
            self.step_or_wait(idle_wait_s)

    def step_or_wait(self, idle_wait_s: float = 0.05) -> bool:
        """One step, or, with nothing to do, a sleep of at most `idle_wait_s` that new work cuts
        short (a loop that does more between steps than `run`: moekit.serve.sharded). → busy."""
        try:
            busy = self.step()
        except Exception as err:  # noqa: BLE001 - a bug must not leave every client waiting forever
            self.abort_all(f"internal error in the scheduler: {_message(err)}", reason="error")
            busy = False
        if not busy:
            self._wake.wait(idle_wait_s)
            self._wake.clear()
        return busy

    def run_until_idle(self) -> None:
        """Step until nothing runs or waits (tests and offline batches)."""
        while self.step():
            pass

    def abort_all(self, message: str, reason: str = "cancelled") -> None:
        """End every waiting and running request with `reason` (shutdown past its grace period,
        or a scheduler that failed as a whole)."""
        with self._lock:
            waiting = [r for q in self.waiting.values() for r in q]
            for q in self.waiting.values():
                q.clear()
        for request in waiting + self._admitting:
            self._finish_unstarted(request, reason, message)
        self._admitting = []
        if self._fill is not None:
            for row in self._fill.rows:
                row.finish, row.error = reason, message
                self._finish(row)
            self._fill = None
        self._riding = None
        for row in self.rows:
            row.finish, row.error = reason, message
        self._release()

    # ---- the scheduler's own thread ----

    @property
    def num_prefilling(self) -> int:
        """Requests whose prompt is being prefilled in chunks."""
        return 0 if self._fill is None else len(self._fill.rows)

    def step(self) -> bool:
        """Release, admit (prefill at most prefill_tokens prompt tokens), decode once. False when
        there was nothing to do."""
        started = time.perf_counter()
        self._run_between()
        self._riding = None
        with torch.inference_mode():
            self._release()
            admitted = self._admit()
            self._let_first_tokens_out()
            self._meter_held(self.rows)
            self._release()  # a request can finish at its first token
            batch = len(self.rows)
            if batch:
                admitted += self._decode()
            elif self._riding is not None:
                admitted += self._chunk_alone()
        if self.on_step is not None and (batch or admitted):
            self.on_step(StepStats(batch=batch, admitted=admitted, seconds=time.perf_counter() - started))
        return bool(batch or admitted or self.num_waiting or self._fill is not None)

    def _pop_admissible(self, width: int, count: int, budget: int) -> Optional[Request]:
        """The next waiting request (tier order) if a left-padded prefill of `count` + 1 prompts
        stays within `budget`, the step's prefill tokens left; when the step has prefilled nothing
        yet, the first is taken whatever its length (a long one is then prefilled in chunks)."""
        with self._lock:
            for tier in TIERS:
                queue = self.waiting[tier]
                if queue:
                    request = queue[0]
                    fresh = count == 0 and budget == self.prefill_tokens and self._fill is None
                    if not fresh and (count + 1) * max(width, len(request.prompt)) > budget:
                        return None
                    return queue.popleft()
        return None

    def _admit(self) -> int:
        """Take waiting requests into free rows (see _admit_round). When no row was running and a
        round took every request that was waiting, those that arrived during its prefill are taken
        too, before the decode, within what is left of the step's prefill budget: a burst of
        arrivals rarely lands at once, and its late part would otherwise wait for a decode step of
        its first part, and run a step behind it from then on. With rows running, a second prefill
        would hold up their decode for one arrival's sake: it waits for the next step.
        → rows that started this step."""
        idle = not self.rows
        started, budget, drained = self._admit_round(self.prefill_tokens)
        while idle and drained and budget > 0 and self.num_waiting and self._fill is None:
            more, left, drained = self._admit_round(budget)
            if left == budget:  # nothing fitted
                break
            started, budget = started + more, left
        return started

    def _admit_round(self, budget: int) -> tuple[int, int, bool]:
        """Take waiting requests into free rows: one left-padded prefill for all of them, within
        `budget` prefill tokens, after the next chunk of a prompt prefilled in chunks. → (rows
        started, budget left, whether no request was left waiting when the round took its last)."""
        placed = 0
        if self._fill is not None:
            budget, placed = self._continue_fill(budget)
        rows: list[_Row] = []
        width = 0
        while len(self.rows) + len(rows) + self.num_prefilling < self.max_batch and budget > 0:
            request = self._pop_admissible(width, len(rows), budget)
            if request is None:
                break
            if request.cancelled:
                self._finish_unstarted(request, "cancelled", None)
                continue
            self._admitting.append(request)
            try:
                row = self._new_row(request, rows)
            except Exception as err:  # noqa: BLE001 - e.g. a seed the generator refuses: this request alone fails
                self._finish_unstarted(request, "error", f"setting up the request failed: {_message(err)}")
                continue
            rows.append(row)
            width = max(width, len(request.prompt))
        drained = self.num_waiting == 0
        spent = len(rows) * width  # the padded prefill below, at most (a cached prefix costs less)
        # A policy's state must not see another prompt's pads, and a cached prefix was routed exactly on
        # the served weights: rows with a policy or on a canary prefill alone, uncached (and whole:
        # a policy's run and a canary's weights are a step's, not kept across steps).
        alone = [row for row in rows if row.run is not None or self._on_canary(row.request)]
        for row in alone:
            self._prefill([row])
        groups = _sharing_prefill([row for row in rows if not any(row is other for other in alone)])
        cold: list[tuple[list[_Row], list[bytes]]] = []
        for group in groups:
            keys, blocks = self._cached_prefix(group[0].request)
            if _scores_prompt(group):
                blocks = []  # a prompt's logprobs need every position computed
            if group[0].length - self._cached_tokens(blocks) > budget and self._fill is None:
                self._fill = self._start_fill(group, keys, blocks, chunked=True)  # too long for one step: in chunks
                if self._fill is not None:
                    budget, _ = self._continue_fill(budget)
            elif blocks:
                self._prefill(group, keys, blocks)
            else:
                cold.append((group, keys))
        if len(cold) == 1:
            self._prefill(*cold[0])
        elif cold:
            self._prefill_together(cold)
        self._admitting = []
        chunking = self._fill is not None and any(row is self._fill.head for row in rows)
        return len(rows) - (len(self._fill.rows) if chunking else 0) + placed, max(budget - spent, 0), drained

    def _cached_tokens(self, blocks: Sequence[Block]) -> int:
        return len(blocks) * self.prefix_cache.block_size if blocks else 0

    def _cached_prefix(self, request: Request) -> tuple[list[bytes], list[Block]]:
        """The prompt's block keys and the leading blocks found cached (none without a cache)."""
        if self.prefix_cache is None:
            return [], []
        # The row's K shapes its prompt's routing and so its KV: it salts the keys.
        keys = self.prefix_cache.keys(request.prompt, salt=f"top_k={self._row_k(request)}")
        return keys, self.prefix_cache.lookup(request.prompt, keys)

    def _keep_blocks(self, keys: list[bytes], cache, index: int, base: int, cached: int, decisions: list, width: int) -> None:
        """Put the prompt's full blocks that were computed (not found cached) into the prefix cache:
        prompt token p sits in slot base + p of cache row `index` and, as the forward's input, in
        column base + p - cached of its row of `width` tokens."""
        if self.prefix_cache is None:
            return
        size = self.prefix_cache.block_size
        for j in range(cached // size, len(keys)):
            start = base + j * size
            routing = routing_rows(decisions, start - cached, size, width, index)
            self.prefix_cache.insert(keys[j], Block(read_slots(cache, index, start, size), routing))
        self.prefix_cache.touch(keys)

    def _row_k(self, request: Request) -> int:
        if not self.model_k:
            return 0
        if request.routing is not None:
            return policy_width(request.routing, self.model_k)  # the policy decides each token's experts, at most this many
        return request.top_k if request.top_k is not None else tier_top_k(request.tier, self.model_k)

    def _new_row(self, request: Request, admitting: Sequence[_Row] = ()) -> _Row:
        return _Row(
            request=request,
            top_k=self._row_k(request),
            generator=make_generator(request.sampling, self.device),
            length=len(request.prompt),
            admitted_at=time.perf_counter(),
            run=None if request.routing is None or not self.model_k else self._run_for(request.routing, admitting),
        )

    def _run_for(self, policy, admitting: Sequence[_Row]) -> PolicyRun:
        """A request's run of its policy, counting into the server's ledger for that policy. A
        batch-level policy's rows share one run while any of them runs (so its state and its
        capacity span the batch); the first row after none starts a fresh one, as a lone run does."""
        ledger = self.policy_stats.setdefault(str(policy), {})
        if not is_batch_level(policy):
            return PolicyRun(policy, 1, ledger)
        shared = next((row.run for row in [*self.rows, *admitting] if row.run is not None and row.run.policy == policy), None)
        return shared if shared is not None else PolicyRun(policy, 1, ledger)

    def _prefill(self, rows: list[_Row], keys: Sequence[bytes] = (), blocks: Sequence[Block] = ()) -> None:
        """Prefill one prompt alone into a cache of its size, after its first C tokens' KV taken from
        `blocks` (the prefix cache's), then copy it into a free row for each of `rows` (requests with
        this prompt and K)."""
        fill = self._start_fill(rows, keys, blocks)
        if fill is not None and self._fill_chunk(fill, fill.left):
            self._end_fill(fill)

    def _start_fill(self, rows: list[_Row], keys: Sequence[bytes], blocks: Sequence[Block],
                    chunked: bool = False) -> Optional[_Fill]:
        """A prompt's prefill set up: its own cache, holding the KV of `blocks` (a cached prefix).
        chunked: prefilled in chunks, its cache a slot longer than the prompt (within max_len), so
        that every chunk, the last too, is the one compiled shape the mixed step takes (a chunk
        that fills its cache would be another graph). None if that failed (its rows have failed
        and finished)."""
        cached = self._cached_tokens(blocks)
        try:
            single = self.decoder.new_cache(1, rows[0].length + (chunked and rows[0].length < self.max_len))
            for i, block in enumerate(blocks):
                write_slots(single, 0, i * self.prefix_cache.block_size, block.slots)
        except Exception as err:  # noqa: BLE001 - a request that fails must fail alone
            self._fail(rows, err)
            return None
        single.length = cached
        for row in rows:
            row.cached = cached
            self._meter_cached(row, blocks)
        return _Fill(rows=rows, keys=list(keys), cached=cached, cache=single, done=cached)

    def _fail(self, rows: list[_Row], err: Exception) -> None:
        for row in rows:
            row.finish, row.error = "error", _message(err)
            self._finish(row)

    def _fill_chunk(self, fill: _Fill, tokens: int) -> bool:
        """The next `tokens` of the prompt into its cache, after the ones before (whose KV it holds).
        → whether it went well (if not, its rows have failed and finished)."""
        head = fill.head
        end = fill.done + tokens
        prompt = torch.tensor([list(head.request.prompt[fill.done : end])], dtype=torch.int64, device=self.device)  # [1, T]
        positions = torch.arange(fill.done, end, device=self.device)[None]  # [1, T]
        top_k = None if head.top_k == self.model_k else [head.top_k] * tokens
        decisions: list = []
        try:
            with self._weights_for(head.request):
                logits = self._prompt_forward(tokens)(prompt, fill.cache, positions, decisions,
                                                      last_only=not _scores_prompt(fill.rows), top_k=top_k,
                                                      policy=head.run)  # [1, T|1, V]
        except Exception as err:  # noqa: BLE001 - a request that fails must fail alone
            self._fail(fill.rows, err)
            return False
        fill.decisions.append(decisions)
        fill.logits.append(logits[0])
        fill.done = end
        return True

    def _prompt_forward(self, tokens: int):
        """The decoder's forward for `tokens` prompt tokens a row on a prompt's own cache. One token
        (a one-token prompt, what a cached prefix leaves) runs the modules' forward: Decoder.forward
        would run it as a decode step, whose graphs a server traced on its batch cache's rows, and a
        prompt's cache (one row, or as many rows as prompts) is another shape, which compiles a graph
        of its own in the middle of serving (seen: ~16 s, every running row waiting)."""
        return self.decoder.forward_modules if tokens == 1 else self.decoder

    def _end_fill(self, fill: _Fill) -> None:
        """A prompt prefilled: its metering held (_hold_prompt), its blocks kept, its rows started."""
        decisions = _joined(fill.decisions)
        for row in fill.rows:
            self._hold_prompt(row, [(layer, d.topk_ids) for layer, d in decisions], row is fill.head)
        width = fill.head.length - fill.cached
        self._keep_blocks(fill.keys, fill.cache, 0, 0, fill.cached, decisions, width)
        logits = torch.cat(fill.logits) if _scores_prompt(fill.rows) else fill.logits[-1]  # [P-C, V] or [1, V]
        self._place(fill.rows, fill.cache, 0, 0, logits)

    def _continue_fill(self, budget: int) -> tuple[int, int]:
        """The prompt prefilled in chunks: its next chunk (at most `budget` tokens), and, after the
        last, its rows started. → (budget left, rows started)."""
        fill = self._fill
        fill.rows = [row for row in fill.rows if not self._cancelled(row)]
        if not fill.rows:
            self._fill = None
            return budget, 0
        tokens = chunk_tokens(min(budget, fill.left), fill.left)
        riding = chunk_tokens(min(tokens, max(MIXED_TOKENS - len(self.rows), MIXED_FLOOR)), fill.left)
        if self.decoder.mixes(len(self.rows), riding):
            self._riding = riding  # run in the decode step's forward where it can (_decode_mixed)
            return budget - riding, 0
        if not self._fill_chunk(fill, tokens):
            self._fill = None
            return budget - tokens, 0
        return budget - tokens, self._chunk_done(fill)

    def _chunk_done(self, fill: _Fill) -> int:
        """After a chunk of fill: if it was the last, its rows started. → rows started."""
        if fill.left:
            return 0
        self._fill = None
        self._end_fill(fill)
        return len(fill.rows)

    def _chunk_alone(self) -> int:
        """The chunk that was to ride in the decode step (_riding) run as a forward of its own, as
        every chunk was before the mixed step: before the decode, the rows of a last chunk started
        and any that ended at their first token released. → rows started."""
        tokens, self._riding = self._riding, None
        fill = self._fill
        if not self._fill_chunk(fill, tokens):
            self._fill = None
            return 0
        started = self._chunk_done(fill)
        self._meter_held(self.rows)  # before the decode step that follows meters the rows it started
        self._release()
        return started

    def _decode_mixed(self) -> Optional[int]:
        """The step's decode and the riding chunk in one forward (Decoder.forward_mixed), where every
        running row routes the family's way at the model's K and the prompt takes the prefill form
        (no per-row K, policy or canary; its logprobs not asked for). Metered, started and failed as
        the two forwards would be. → rows the chunk started, or None where it did not run (nothing
        written that the two forwards do not write again)."""
        fill, tokens, rows = self._fill, self._riding, self.rows
        head = fill.head
        if head.run is not None or head.top_k != self.model_k or _scores_prompt(fill.rows) \
                or self._on_canary(head.request) or any(self._on_canary(row.request) for row in rows) \
                or self._routing(rows) != (None, None):
            return None
        ids, lengths, _ = self._step_inputs(rows)
        chunk = torch.tensor([list(head.request.prompt[fill.done : fill.done + tokens])], dtype=torch.int64,
                             device=self.device)  # [1, T]
        decisions: list = []
        chunk_decisions: list = []
        try:
            out = self.decoder.forward_mixed(ids, self.cache, lengths, chunk, fill.cache, decisions, chunk_decisions)
        except Exception:  # noqa: BLE001 - the two forwards find which request fails; the others go on
            return None
        if out is None:
            return None
        logits, chunk_logits = out  # [B, 1, V], [1, 1, V]
        self._riding = None
        fill.decisions.append(chunk_decisions)
        fill.logits.append(chunk_logits[0])
        fill.done += tokens
        self._stepped(rows, decisions, logits[:, -1])
        return self._chunk_done(fill)

    def _cancelled(self, row: _Row) -> bool:
        """A row whose request was cancelled while its prompt was prefilled: it ends now."""
        if not row.request.cancelled:
            return False
        row.finish = "cancelled"
        self._finish(row)
        return True

    def _prefill_together(self, cold: list[tuple[list[_Row], list[bytes]]]) -> None:
        """Several prompts (none with a cached prefix; each a group of rows that share it, with its
        block keys) in one left-padded forward (as a batched `generate` prefills them), each row's
        real slots then copied into its cache row. If the forward fails, each is prefilled alone, so
        only the request that fails fails."""
        groups = [group for group, _ in cold]
        heads = [group[0] for group in groups]
        ids, mask, positions = left_pad([row.request.prompt for row in heads], pad_id=0)  # [B, P] each
        b, width = ids.shape
        top_k = None
        if any(row.top_k != self.model_k for row in heads):
            top_k = [row.top_k for row in heads for _ in range(width)]  # row-major, as the tokens
        decisions: list = []
        try:
            cache = self.decoder.new_cache(b, width)
            cache.key_mask[:] = mask.to(self.device)
            last_only = not any(_scores_prompt(group) for group in groups)
            logits = self._prompt_forward(width)(ids.to(self.device), cache, positions.to(self.device), decisions,
                                                 last_only=last_only, top_k=top_k)
        except Exception:  # noqa: BLE001
            for group, keys in cold:
                self._prefill(group, keys)
            return
        for i, group in enumerate(groups):
            first = width - group[0].length
            per_row = [(layer, d.topk_ids.view(b, width, -1)[i, first:]) for layer, d in decisions]  # [P_i, K]
            for row in group:
                self._hold_prompt(row, per_row, row is group[0])
            self._keep_blocks(cold[i][1], cache, i, first, 0, decisions, width)
        for i, group in enumerate(groups):
            first = width - group[0].length
            self._place(group, cache, i, first, logits[i, first:] if not last_only else logits[i])

    def _place(self, rows: list[_Row], cache, index: int, start: int, logits: torch.Tensor) -> None:
        """Rows that share a prefill: each gets the prompt's logprobs it asked for, a copy of
        cache row `index` (slots from `start`) and its first token sampled from logits[-1].
        logits: [P, V] when some row scores its prompt, else [1, V]."""
        for row in rows:
            request = row.request
            if request.prompt_logprobs is not None and request.on_prompt_logprobs is not None:
                request.on_prompt_logprobs(prompt_logprobs(logits, request.prompt, request.prompt_logprobs))
        running = []
        for row in rows:
            if row.request.max_new_tokens == 0:  # scored its prompt: nothing to generate
                row.finish = "length"
                self._finish(row)
                continue
            copy_row(self.cache, len(self.rows), cache, index, row.length, src_start=start)
            self.rows.append(row)
            running.append(row)
        if running:
            self._advance(running, logits[-1:].expand(len(running), -1))

    def _let_first_tokens_out(self) -> None:
        """After the step's prefills, before its metering and decode: wait, at most
        first_token_wait_s in all, until the clients of the first tokens they made have passed them
        on (their `first_passed` events)."""
        # Taken here, not emptied as the step starts: a last chunk that rode in the decode before
        # (_decode_mixed) made its rows' first tokens after that step's wait, and this one waits for them.
        events, self._first_passed = self._first_passed, []
        if not events or self.first_token_wait_s <= 0:
            return
        deadline = time.perf_counter() + self.first_token_wait_s
        for event in events:
            left = deadline - time.perf_counter()
            if left <= 0 or not event.wait(left):
                return

    def _decode(self) -> int:
        """The running rows' decode step, with the chunk riding in it (_riding) where there is one:
        one forward where it can (_decode_mixed), else the chunk's own forward first. → rows the
        chunk started."""
        started = 0
        if self._riding is not None:
            mixed = self._decode_mixed()
            if mixed is not None:
                return mixed
            started = self._chunk_alone()
            if not self.rows:
                return started
        self._decode_rows()
        return started

    def _step_inputs(self, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A decode step's inputs for rows: ids [B, 1] (each row's last token), lengths [B] (the
        slots each holds) and max(lengths) + 1."""
        held = [row.length for row in rows]
        ids = torch.tensor([[row.tokens[-1]] for row in rows], dtype=torch.int64, device=self.device)  # [B, 1]
        return ids, torch.tensor(held, dtype=torch.int64, device=self.device), max(held) + 1

    def _stepped(self, rows: list[_Row], decisions: list, logits: torch.Tensor, whole: Optional[StepChoices] = None) -> None:
        """After a decode step over rows: metered (_meter_step), each a slot longer, each its next
        token from logits [B, V]."""
        self._meter_step(rows, decisions, whole)
        for row in rows:
            row.length += 1
        self._advance(rows, logits)

    def _decode_rows(self) -> None:
        n = len(self.rows)
        ids, lengths, end = self._step_inputs(self.rows)
        canary = [i for i, row in enumerate(self.rows) if self._on_canary(row.request)]
        top_k, policy = self._routing(self.rows, skip=set(canary))
        decisions: list = []
        choices: list = []  # the step form's routing, whole (StepChoices): the meter reads it at once
        try:
            logits = self.decoder.forward_rows(ids, self.cache, lengths, decisions, top_k, policy, choices, end=end)  # [B, 1, V]
        except Exception:  # noqa: BLE001 - find the row that fails; the others go on
            self._decode_alone()
            return
        if not canary:
            self._stepped(self.rows, decisions, logits[:, -1], choices[0] if choices else None)
            return
        # The batch ran the served weights for every row; the canary rows' results are dropped
        # and each is run again alone on the canary weights (its slot rewritten).
        if choices:
            decisions = choices[0].decisions()
        keep = [i for i in range(n) if i not in set(canary)]
        decisions = [(layer, _rows_of(d, keep)) for layer, d in decisions]
        self._stepped([self.rows[i] for i in keep], decisions, logits[keep][:, -1])
        self._decode_alone(canary)
        assert n == len(self.rows)

    def _on_canary(self, request: Request) -> bool:
        return request.canary and self.canary is not None

    def _weights_for(self, request: Request):
        return self.canary.applied() if self._on_canary(request) else nullcontext()

    def _decode_alone(self, indices: Optional[list[int]] = None) -> None:
        """Run rows (all, or those at `indices`) each on its own: after a batched step raised, so
        only the row that fails fails; and for canary rows, on the canary weights."""
        for index in range(len(self.rows)) if indices is None else indices:
            row = self.rows[index]
            # Rows past 1 where the batch cache has them (1 is a size Dynamo specialises) and a slot
            # past the step's, as the batch cache has: the decode graph a server warmed up takes it,
            # where a cache of one row, full after the step, would compile one of its own mid-serving.
            single = self.decoder.new_cache(min(self.max_batch, 2), min(row.length + 2, self.max_len))
            copy_row(single, 0, self.cache, index, row.length)
            ids = torch.tensor([[row.tokens[-1]]], dtype=torch.int64, device=self.device)
            lengths = torch.tensor([row.length], dtype=torch.int64, device=self.device)
            top_k, policy = self._routing([row])
            decisions: list = []
            try:
                with self._weights_for(row.request):
                    logits = self.decoder.forward_rows(ids, single, lengths, decisions, top_k, policy)
            except Exception as err:  # noqa: BLE001
                row.finish, row.error = "error", _message(err)
                continue
            copy_row(self.cache, index, single, 0, row.length + 1)
            self._stepped([row], decisions, logits[:, -1])

    def _advance(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """logits [B, V] → each row's next token (and its logprobs, from these same logits)."""
        tokens = self._sample(logits, rows)
        scoring = [i for i, row in enumerate(rows) if row.request.logprobs is not None]
        entries: dict[int, TokenLogprob] = {}
        if scoring:
            picked = chosen_logprobs(logits[scoring], [tokens[i] for i in scoring], [rows[i].request.logprobs for i in scoring])
            entries = dict(zip(scoring, picked))
        for i, (row, token) in enumerate(zip(rows, tokens)):
            self._accept(row, token, entries.get(i))

    def _routing(self, rows: list[_Row], skip: frozenset = frozenset()) -> tuple[Optional[list[int]], Optional[RowRouting]]:
        """A decode step's (top_k, policy): None, None when every row routes exactly at the model's K.
        Rows at `skip` are run again alone (canary): routed exactly here, their policy state untouched."""
        runs = [None if i in skip else row.run for i, row in enumerate(rows)]
        if any(run is not None for run in runs):
            return None, RowRouting(runs, [row.top_k for row in rows])
        ks = [row.top_k for row in rows]
        return (None if all(k == self.model_k for k in ks) else ks), None

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """logits [B, V] → one token per row, each with its own sampling settings, generator and grammar."""
        logits = mask_logits(logits, [row.request.constraint for row in rows])  # free rows untouched
        # torch.argmax's indices, by moekit::rows_argmax where built: 6 against 43 µs a step at a 32k vocabulary.
        greedy = greedy_tokens(logits).tolist()
        out = []
        for i, row in enumerate(rows):
            params = row.request.sampling
            if params.greedy:
                out.append(int(greedy[i]))
            else:
                out.append(int(next_tokens(logits[i : i + 1], params, row.generator)[0]))
        return out

    def _accept(self, row: _Row, token: int, logprob: Optional[TokenLogprob] = None) -> None:
        """Row's next token: tell the client, then decide whether the row has ended."""
        row.tokens.append(token)
        if len(row.tokens) == 1:
            row.first_token_at = time.perf_counter()
            if row.request.first_passed is not None:
                self._first_passed.append(row.request.first_passed)
        if logprob is not None and row.request.on_logprob is not None:
            row.request.on_logprob(logprob)
        if row.request.on_token is not None:
            row.request.on_token(token)
        constraint = row.request.constraint
        if constraint is not None:
            try:
                constraint.accept(token)
            except ConstraintError as err:
                row.finish, row.error = "error", str(err)
                return
        if token in row.request.stop_ids or (constraint is not None and constraint.complete):
            row.finish = "stop"
        elif len(row.tokens) >= row.request.max_new_tokens or row.length >= self.max_len:
            row.finish = "length"

    def _release(self) -> None:
        """Finished, cancelled and failed rows leave; the last running row moves into each hole."""
        index = 0
        while index < len(self.rows):
            row = self.rows[index]
            if row.request.cancelled and row.finish is None:
                row.finish = "cancelled"
            if row.finish is None:
                index += 1
                continue
            last = len(self.rows) - 1
            if index != last:
                moved = self.rows[last]
                copy_row(self.cache, index, self.cache, last, moved.length)
                self.rows[index] = moved
            self.rows.pop()
            self._finish(row)

    # ---- metering ----

    def _record(self, row: _Row, layer: int, experts: list[int]) -> None:
        row.touched.update(zip(repeat(layer), experts))  # (layer, e) pairs, without a generator's frame per pair

    def _hold_prompt(self, row: _Row, layers: list, count: bool) -> None:
        """A prompt's metering (_meter_prompt's arguments), held until its first token is on its way
        (_meter_held); at once where an expert store pages experts: its hit meter reads the store's
        last forward, which the next prefill replaces."""
        if self.store is not None:
            self._meter_prompt(row, layers, count)
        else:
            row.unmetered = (layers, count)

    def _meter_held(self, rows: Sequence[_Row]) -> None:
        """Meter the prompts of `rows` that were held (_Row.unmetered): a prefill's metering waits
        until its first token is on its way (~0.5 ms of Python at c = 1 on the ~150M checkpoint, in
        the request's time to first token), and runs before the row's next step is metered or the
        row finishes."""
        for row in rows:
            if row.unmetered is not None:
                (layers, count), row.unmetered = row.unmetered, None
                self._meter_prompt(row, layers, count)

    def _meter_prompt(self, row: _Row, layers: list, count: bool = True) -> None:
        """layers: (layer, topk_ids [P, K]) of this row's prompt tokens. count: add them to the
        server's routed-token counts (once per prefill, not once per row that shares it)."""
        last: dict[int, set] = {}  # the last prompt token's experts: its pass made generated token 0
        for layer, topk_ids in layers:
            ids = [_distinct(t) for t in topk_ids[:, : row.top_k].tolist()]  # [P, ≤k]
            counts = self.expert_tokens[layer]
            for token_ids in ids:
                self._record(row, layer, token_ids)
                for e in token_ids:
                    counts[e] += count
            row.work = row.work + self._prompt_work(layer, ids)
            last[layer] = set(ids[-1])
            self._meter_cache(row, layer, {e for t in ids for e in t})
        row.work = row.work + work_done(self.counts, {}, self.bytes_per_param, dense_tokens=row.length, head_tokens=1)
        self._meter_token(row, last)

    def _prompt_work(self, layer: int, ids: list[list[int]]) -> WorkDone:
        """The work of prompt tokens whose experts in MoE layer `layer` were ids[t] (distinct): the
        sum of each one's (_work). Where every expert counts at the dtype's whole bytes (no
        expert_bytes) a token's depends only on how many experts it used, so it is counted once per
        count: one work_done per token and layer had cost ~12 ms of Python at the end of a 512-token
        prompt on the ~150M checkpoint, in a step the running rows wait for (measured)."""
        if self.expert_bytes is not None or not isinstance(self.bytes_per_param, int):
            return sum((self._work({layer: token_ids}) for token_ids in ids), WorkDone())
        by_count = Counter(len(token_ids) for token_ids in ids)
        return sum((self._work({layer: range(n)}).times(tokens) for n, tokens in by_count.items()), WorkDone())

    def _meter_cached(self, row: _Row, blocks: Sequence[Block]) -> None:
        """The experts a cached prefix's tokens chose when they were computed: touched by the
        request's prompt, though not run again now (so not counted in expert_tokens or the store)."""
        for block in blocks:
            for layer, topk_ids in block.routing:
                for token_ids in topk_ids[:, : row.top_k].tolist():
                    self._record(row, layer, token_ids)

    def _meter_step(self, rows: list[_Row], decisions: list, whole: Optional[StepChoices] = None) -> None:
        """A decode step's routing, from `decisions` (layer, RoutingDecision [B, K]) or, where the
        step's form ran, `whole` (read with one tolist a tensor: this runs on every token)."""
        used: list[dict[int, set]] = [{} for _ in rows]
        if whole is not None:
            layers = whole.layers
            per_layer = whole.chosen.tolist()  # [L_moe][B][K]
            entropy = whole.entropy.tolist() if whole.entropy is not None else None  # [L_moe][B]
        else:
            layers = [layer for layer, _ in decisions]
            per_layer = [decision.topk_ids.tolist() for _, decision in decisions]
            entropy = None
            if decisions and decisions[0][1].entropy is not None:
                entropy = [decision.entropy.tolist() for _, decision in decisions]
        if entropy is not None:
            positions = [row.length for row in rows]
            for layer, values in zip(layers, entropy):
                self.entropy.add(layer, positions, values)
        for layer, ids in zip(layers, per_layer):
            counts = self.expert_tokens[layer]
            for i, row in enumerate(rows):
                chosen = _distinct(ids[i][: row.top_k])  # a policy's narrower tokens repeat their first expert
                self._record(row, layer, chosen)
                for e in chosen:
                    counts[e] += 1
                used[i][layer] = set(chosen)
                if self.store is not None:
                    self._meter_cache(row, layer, set(chosen))
        for row, per_layer in zip(rows, used):
            work, active, read = self._token_cost(per_layer)
            row.work = row.work + work
            row.active.append(active)
            row.bytes_sum += read

    def _token_cost(self, chosen: dict[int, set]) -> tuple[WorkDone, int, int]:
        """A generated token's work, active params and bytes read (what _meter_token counts), its row
        having used the experts chosen[l] in MoE layer l. Where every expert counts at the dtype's
        bytes (no expert_bytes) these depend on how many experts each layer used, not which: kept per
        count, as every step of a row at its K asks for the same one (the meter of one row of the ~150M
        checkpoint, 8 layers: 16 against 22 µs a step with the changes beside it; docs/BENCHMARKS.md)."""
        key = None
        if self.expert_bytes is None:
            key = tuple((layer, len(ids)) for layer, ids in chosen.items())
            known = self._token_costs.get(key)
            if known is not None:
                return known
        work = work_done(self.counts, chosen, self.bytes_per_param, self.expert_bytes, dense_tokens=1, head_tokens=1)
        cost = (work, self._active(chosen),
                pass_bytes_around(self.counts, chosen, self.bytes_per_param, work.expert_bytes, dense_saving=self.dense_saving))
        if key is not None and len(self._token_costs) < TOKEN_COSTS_KEPT:
            self._token_costs[key] = cost
        return cost

    def _active(self, chosen: dict[int, set]) -> int:
        return self.counts.active({layer: len(ids) for layer, ids in chosen.items()})

    def _work(self, chosen: dict) -> WorkDone:
        return work_done(self.counts, chosen, self.bytes_per_param, self.expert_bytes)

    def _meter_cache(self, row: _Row, layer: int, chosen: set) -> None:
        """A paged layer's last forward: which of the experts this row chose had to be read."""
        if self.store is None or layer not in self.store.layers:
            return
        missed = len(chosen & self.store.layers[layer].last_misses)
        row.misses += missed
        row.hits += len(chosen) - missed

    def _meter_token(self, row: _Row, chosen: dict[int, set]) -> None:
        """One generated token's pass: chosen[l] is the experts its row used in MoE layer l."""
        row.active.append(self._active(chosen))
        row.bytes_sum += pass_bytes(self.counts, chosen, self.bytes_per_param, self.expert_bytes,
                                    dense_saving=self.dense_saving)

    def _usage(self, row: _Row) -> MoeUsage:
        n = len(row.tokens)
        active = sum(row.active) / n if n else 0.0
        return MoeUsage(
            top_k=row.top_k,
            tier=row.request.tier,
            generated_tokens=n,
            active_params_per_token=active,
            active_share=active / self.counts.total_params if n else 0.0,
            bytes_read_per_token=row.bytes_sum / n if n else 0.0,
            experts_touched=len(row.touched),
            cache_hits=row.hits if self.store is not None else None,
            cache_misses=row.misses if self.store is not None else None,
            routing=None if row.request.routing is None else str(row.request.routing),
            work=row.work,
        )

    def _finish(self, row: _Row) -> None:
        request = row.request
        if request.finished:
            return
        request.finished = True
        self._meter_held([row])
        if request.on_finish is not None:
            request.on_finish(
                Outcome(
                    token_ids=list(row.tokens),
                    finish_reason=row.finish or "cancelled",
                    usage=self._usage(row),
                    error=row.error,
                    active_params=list(row.active),
                    submitted_at=request.submitted_at,
                    admitted_at=row.admitted_at,
                    first_token_at=row.first_token_at,
                    finished_at=time.perf_counter(),
                    cached_tokens=row.cached,
                )
            )

    def _finish_unstarted(self, request: Request, reason: str, error: Optional[str]) -> None:
        row = _Row(request=request, top_k=self._row_k(request), generator=None, length=0)
        row.finish, row.error = reason, error
        self._finish(row)


def chunk_tokens(tokens: int, left: int) -> int:
    """The size of a chunk of a prompt with `left` tokens to go, asked to be `tokens`: never one
    token, nor leaving one (but where `left` is 1): a one-token chunk is a T = 1 forward on the
    prompt's own cache (Scheduler._prompt_forward), and the mixed step takes chunks of two or more.
    The chunk stays within the ask but where the ask is one or two tokens (then two or three)."""
    n = min(max(tokens, 2), left)
    if left - n == 1:
        n = n - 1 if n > 2 else n + 1
    return n


def _joined(chunks: list[list]) -> list:
    """Per-chunk decisions [(layer, RoutingDecision)] of one prompt → one list over its tokens in order."""
    if len(chunks) == 1:
        return chunks[0]
    out = []
    for parts in zip(*chunks):
        layer = parts[0][0]
        entropy = None if parts[0][1].entropy is None else torch.cat([d.entropy for _, d in parts])
        out.append((layer, RoutingDecision(torch.cat([d.topk_ids for _, d in parts]),
                                           torch.cat([d.topk_weights for _, d in parts]), entropy)))
    return out


def _sharing_prefill(rows: list[_Row]) -> list[list[_Row]]:
    """Rows with the same prompt and K, in order of first appearance: each group needs one prefill."""
    groups: dict[tuple, list[_Row]] = {}
    for row in rows:
        groups.setdefault((tuple(row.request.prompt), row.top_k), []).append(row)
    return list(groups.values())


def _scores_prompt(rows: list[_Row]) -> bool:
    return any(row.request.prompt_logprobs is not None for row in rows)


def _rows_of(decision: RoutingDecision, keep: list[int]) -> RoutingDecision:
    """The decision of a decode step's rows at `keep` (one token per row)."""
    return RoutingDecision(decision.topk_ids[keep], decision.topk_weights[keep],
                           None if decision.entropy is None else decision.entropy[keep])


def _distinct(ids: list[int]) -> list[int]:
    return list(dict.fromkeys(ids))


def _message(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def generate_batch(scheduler: Scheduler, requests: Sequence[Request]) -> list[Outcome]:
    """Submit every request, step until all have finished, and return their outcomes in order."""
    outcomes: dict[int, Outcome] = {}
    for i, request in enumerate(requests):
        request.on_finish = lambda outcome, i=i: outcomes.__setitem__(i, outcome)
        scheduler.submit(request)
    scheduler.run_until_idle()
    return [outcomes[i] for i in range(len(requests))]
