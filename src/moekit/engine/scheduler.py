"""Continuous (iteration-level) batching: requests join and leave a running decode batch every step.

The scheduler owns `max_batch` rows of one preallocated KV cache. Each step it
  1. lets go of rows that finished, were cancelled or failed, moving the last running row into
     each freed one, so the running rows are always 0..n-1 and their cache is a view, never gathered;
  2. admits waiting requests into free rows, tier S before A before B: each is prefilled alone,
     exactly as a lone `generate` prefills it, and its cache copied into its row;
  3. runs one decode step over every running row (Decoder.forward_rows): each row at its own
     length and RoPE position, with its own K; an expert chosen by any row is read once.
Sampling is per row, with the request's own settings and seed, so a greedy or seeded request gets
what it gets alone. The scheduler knows no HTTP: a request hears of its tokens and its end through
its callbacks, which run on the scheduler's thread and must return quickly.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from contextlib import nullcontext
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from moekit.engine.generate import check_request, left_pad
from moekit.engine.meter import ExpertBytes, ParamsPerToken, WorkDone, params_per_token, pass_bytes, work_done
from moekit.engine.router_health import EntropyTally
from moekit.engine.row_routing import RowRouting
from moekit.engine.sampling import SamplingParams, check_sampling, make_generator, next_tokens
from moekit.errors import MoekitError
from moekit.model.cache import copy_row
from moekit.model.routing import PolicyRun, RoutingDecision

TIERS = ("S", "A", "B")  # admitted in this order


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
    `experts_touched`, since those experts had to be read too)."""

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


@dataclass(eq=False)
class Request:
    prompt: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    tier: str = "S"
    top_k: Optional[int] = None  # experts per token; None: the tier's
    routing: Optional[object] = None  # a moekit.model.routing policy; None: exact at top_k
    canary: bool = False  # runs on the canary weights while a canary is on (moekit.serve.canary)
    on_token: Optional[Callable[[int], None]] = None  # each new token id
    on_finish: Optional[Callable[[Outcome], None]] = None
    cancelled: bool = False  # set by Scheduler.cancel; the row leaves at the next step
    submitted_at: float = 0.0


@dataclass(eq=False)
class _Row:
    """A running request: its cache row's length, its sampler and its meter."""

    request: Request
    top_k: int
    generator: Optional[torch.Generator]
    length: int  # slots written in its cache row
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
    ):
        """max_len: slots per row (prompt + generated), at most the model's context.
        bytes_per_param, expert_bytes, dense_saving: what the usage meter counts a weight and each
        routed expert at, and what int8 projections save (the engine's: Engine.bytes_per_param,
        .expert_bytes and .dense_saving, so that a request's bytes per token are what `moekit run`
        meters for it).
        queue_limit: waiting requests per tier before submit refuses (QueueFull).
        prefill_tokens: padded prompt tokens one step may prefill together (one request always):
        a burst of arrivals is prefilled in one forward instead of one after another."""
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
        self.prefill_tokens = prefill_tokens
        self.store = store
        self.on_step = on_step
        self.counts: ParamsPerToken = params_per_token(spec)
        self.model_k = max(self.counts.top_k.values(), default=0)
        self.moe_layers = sorted(self.counts.top_k)
        experts = max((spec.layers[l].ffn.num_experts for l in self.moe_layers), default=0)
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
        self.waiting = {tier: deque() for tier in TIERS}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._between: deque = deque()  # (callable, Future): run on this thread between two steps

    # ---- the client side (any thread) ----

    def check(self, request: Request) -> None:
        """Refuse what cannot run, before it is queued: one line naming the problem."""
        check_request([request.prompt], request.max_new_tokens, self.spec.vocab_size, self.max_len)
        check_sampling(request.sampling)
        tier_top_k(request.tier, self.model_k or 1)
        if request.top_k is not None and self.model_k and not 1 <= request.top_k <= self.model_k:
            raise MoekitError(f"top_k must be between 1 and the model's {self.model_k}, got {request.top_k}")

    def submit(self, request: Request) -> Request:
        self.check(request)
        request.submitted_at = time.perf_counter()
        with self._lock:
            queue = self.waiting[request.tier]
            if len(queue) >= self.queue_limit:
                raise QueueFull(f"the tier {request.tier} queue is full ({self.queue_limit} waiting); retry later")
            queue.append(request)
        self._wake.set()
        return request

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
            try:
                busy = self.step()
            except Exception as err:  # noqa: BLE001 - a bug must not leave every client waiting forever
                self.abort_all(f"internal error in the scheduler: {_message(err)}", reason="error")
                busy = False
            if not busy:
                self._wake.wait(idle_wait_s)
                self._wake.clear()

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
        for request in waiting:
            self._finish_unstarted(request, reason, message)
        for row in self.rows:
            row.finish, row.error = reason, message
        self._release()

    # ---- the scheduler's own thread ----

    def step(self) -> bool:
        """Release, admit, decode once. False when there was nothing to do."""
        started = time.perf_counter()
        self._run_between()
        with torch.inference_mode():
            self._release()
            admitted = self._admit()
            self._release()  # a request can finish at its first token
            batch = len(self.rows)
            if batch:
                self._decode()
        if self.on_step is not None and (batch or admitted):
            self.on_step(StepStats(batch=batch, admitted=admitted, seconds=time.perf_counter() - started))
        return bool(batch or admitted or self.num_waiting)

    def _pop_admissible(self, width: int, count: int) -> Optional[Request]:
        """The next waiting request (tier order) if a left-padded prefill of `count` + 1 prompts
        stays within the step's prefill budget; the first of a step is always admitted."""
        with self._lock:
            for tier in TIERS:
                queue = self.waiting[tier]
                if queue:
                    request = queue[0]
                    if count and (count + 1) * max(width, len(request.prompt)) > self.prefill_tokens:
                        return None
                    return queue.popleft()
        return None

    def _admit(self) -> int:
        """Take waiting requests into free rows: one left-padded prefill for all of them."""
        group: list[Request] = []
        width = 0
        while len(self.rows) + len(group) < self.max_batch:
            request = self._pop_admissible(width, len(group))
            if request is None:
                break
            if request.cancelled:
                self._finish_unstarted(request, "cancelled", None)
                continue
            group.append(request)
            width = max(width, len(request.prompt))
        # A policy's state must not see another prompt's pads: rows with a policy prefill alone.
        together = [r for r in group if r.routing is None and not self._on_canary(r)]
        for request in group:
            if request not in together or len(together) == 1:
                self._prefill(request)
        if len(together) > 1:
            self._prefill_together(together)
        return len(group)

    def _row_k(self, request: Request) -> int:
        if not self.model_k:
            return 0
        if request.routing is not None:
            return self.model_k  # the policy decides each token's experts; the decision is at most K wide
        return request.top_k if request.top_k is not None else tier_top_k(request.tier, self.model_k)

    def _new_row(self, request: Request) -> _Row:
        return _Row(
            request=request,
            top_k=self._row_k(request),
            generator=make_generator(request.sampling, self.device),
            length=len(request.prompt),
            admitted_at=time.perf_counter(),
            run=None if request.routing is None or not self.model_k else PolicyRun(request.routing, 1),
        )

    def _prefill(self, request: Request) -> None:
        """Prefill alone into a cache of the prompt's size, then copy it into the next free row."""
        row = self._new_row(request)
        prompt = torch.tensor([list(request.prompt)], dtype=torch.int64, device=self.device)  # [1, P]
        positions = torch.arange(prompt.shape[1], device=self.device)[None]  # [1, P]
        top_k = None if row.top_k == self.model_k else [row.top_k] * prompt.shape[1]
        decisions: list = []
        try:
            single = self.decoder.new_cache(1, prompt.shape[1])
            with self._weights_for(request):
                logits = self.decoder(prompt, single, positions, decisions, last_only=True, top_k=top_k, policy=row.run)  # [1, 1, V]
            self._meter_prompt(row, [(layer, d.topk_ids) for layer, d in decisions])
        except Exception as err:  # noqa: BLE001 - a request that fails must fail alone
            row.finish, row.error = "error", _message(err)
            self._finish(row)
            return
        copy_row(self.cache, len(self.rows), single, 0, row.length)
        self.rows.append(row)
        self._accept(row, int(next_tokens(logits[:, -1], request.sampling, row.generator)[0]))

    def _prefill_together(self, requests: list[Request]) -> None:
        """Several prompts in one left-padded forward (as a batched `generate` prefills them), each
        row's real slots then copied into its cache row. If the forward fails, each is prefilled
        alone, so only the request that fails fails."""
        rows = [self._new_row(r) for r in requests]
        ids, mask, positions = left_pad([r.prompt for r in requests], pad_id=0)  # [B, P] each
        b, width = ids.shape
        top_k = None
        if any(row.top_k != self.model_k for row in rows):
            top_k = [row.top_k for row in rows for _ in range(width)]  # row-major, as the tokens
        decisions: list = []
        try:
            cache = self.decoder.new_cache(b, width)
            cache.key_mask[:] = mask.to(self.device)
            logits = self.decoder(ids.to(self.device), cache, positions.to(self.device), decisions, last_only=True, top_k=top_k)
        except Exception:  # noqa: BLE001
            for request in requests:
                self._prefill(request)
            return
        for i, row in enumerate(rows):
            first = width - row.length
            per_row = [(layer, d.topk_ids.view(b, width, -1)[i, first:]) for layer, d in decisions]  # [P_i, K]
            self._meter_prompt(row, per_row)
            copy_row(self.cache, len(self.rows), cache, i, row.length, src_start=first)
            self.rows.append(row)
        for row, token in zip(rows, self._sample(logits[:, -1], rows)):
            self._accept(row, token)

    def _decode(self) -> None:
        n = len(self.rows)
        ids = torch.tensor([[row.tokens[-1]] for row in self.rows], dtype=torch.int64, device=self.device)  # [B, 1]
        lengths = torch.tensor([row.length for row in self.rows], dtype=torch.int64, device=self.device)  # [B]
        canary = [i for i, row in enumerate(self.rows) if self._on_canary(row.request)]
        top_k, policy = self._routing(self.rows, skip=set(canary))
        decisions: list = []
        try:
            logits = self.decoder.forward_rows(ids, self.cache, lengths, decisions, top_k, policy)  # [B, 1, V]
        except Exception:  # noqa: BLE001 - find the row that fails; the others go on
            self._decode_alone()
            return
        if canary:
            # The batch ran the served weights for every row; the canary rows' results are dropped
            # and each is run again alone on the canary weights (its slot rewritten).
            keep = [i for i in range(n) if i not in set(canary)]
            decisions = [(layer, _rows_of(d, keep)) for layer, d in decisions]
            logits = logits[keep]
        rows = [row for i, row in enumerate(self.rows) if i not in set(canary)]
        self._meter_step(rows, decisions)
        for row, token in zip(rows, self._sample(logits[:, -1], rows)):
            row.length += 1
            self._accept(row, token)
        if canary:
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
            single = self.decoder.new_cache(1, row.length + 1)
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
            self._meter_step([row], decisions)
            row.length += 1
            self._accept(row, self._sample(logits[:, -1], [row])[0])

    def _routing(self, rows: list[_Row], skip: frozenset = frozenset()) -> tuple[Optional[list[int]], Optional[RowRouting]]:
        """A decode step's (top_k, policy): None, None when every row routes exactly at the model's K.
        Rows at `skip` are run again alone (canary): routed exactly here, their policy state untouched."""
        runs = [None if i in skip else row.run for i, row in enumerate(rows)]
        if any(run is not None for run in runs):
            return None, RowRouting(runs, [row.top_k for row in rows])
        ks = [row.top_k for row in rows]
        return (None if all(k == self.model_k for k in ks) else ks), None

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """logits [B, V] → one token per row, each with its own sampling settings and generator."""
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for i, row in enumerate(rows):
            params = row.request.sampling
            if params.greedy:
                out.append(int(greedy[i]))
            else:
                out.append(int(next_tokens(logits[i : i + 1], params, row.generator)[0]))
        return out

    def _accept(self, row: _Row, token: int) -> None:
        """Row's next token: tell the client, then decide whether the row has ended."""
        row.tokens.append(token)
        if len(row.tokens) == 1:
            row.first_token_at = time.perf_counter()
        if row.request.on_token is not None:
            row.request.on_token(token)
        if token in row.request.stop_ids:
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
        row.touched.update((layer, e) for e in experts)

    def _meter_prompt(self, row: _Row, layers: list) -> None:
        """layers: (layer, topk_ids [P, K]) of this row's prompt tokens."""
        last: dict[int, set] = {}  # the last prompt token's experts: its pass made generated token 0
        for layer, topk_ids in layers:
            ids = [_distinct(t) for t in topk_ids[:, : row.top_k].tolist()]  # [P, ≤k]
            counts = self.expert_tokens[layer]
            for token_ids in ids:
                self._record(row, layer, token_ids)
                for e in token_ids:
                    counts[e] += 1
                row.work = row.work + self._work({layer: token_ids})
            last[layer] = set(ids[-1])
            self._meter_cache(row, layer, {e for t in ids for e in t})
        row.work = row.work + work_done(self.counts, {}, self.bytes_per_param, dense_tokens=row.length, head_tokens=1)
        self._meter_token(row, last)

    def _meter_step(self, rows: list[_Row], decisions: list) -> None:
        used: list[dict[int, set]] = [{} for _ in rows]
        for layer, decision in decisions:
            if decision.entropy is not None:
                self.entropy.add(layer, [row.length for row in rows], decision.entropy.tolist())
            ids = decision.topk_ids.tolist()  # [B, K]
            counts = self.expert_tokens[layer]
            for i, row in enumerate(rows):
                chosen = _distinct(ids[i][: row.top_k])  # a policy's narrower tokens repeat their first expert
                self._record(row, layer, chosen)
                for e in chosen:
                    counts[e] += 1
                used[i][layer] = set(chosen)
                self._meter_cache(row, layer, set(chosen))
        for row, per_layer in zip(rows, used):
            row.work = row.work + work_done(self.counts, per_layer, self.bytes_per_param, self.expert_bytes,
                                            dense_tokens=1, head_tokens=1)
            self._meter_token(row, per_layer)

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
        row.active.append(self.counts.active({layer: len(ids) for layer, ids in chosen.items()}))
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
                )
            )

    def _finish_unstarted(self, request: Request, reason: str, error: Optional[str]) -> None:
        row = _Row(request=request, top_k=self._row_k(request), generator=None, length=0)
        row.finish, row.error = reason, error
        self._finish(row)


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
