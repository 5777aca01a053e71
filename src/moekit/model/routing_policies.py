"""Router knobs and load control at inference: the design essays' mechanisms as opt-in policies.

Each is a frozen dataclass beside routing.py's policies, parsed by routing.parse_policy and run by
routing.route_policy; none is a default. What they do (docs/ROUTING.md has their measured cost):
  temp:T          the family's routing on logits / T (T = 1 is exact routing)
  gumbel:σ[:seed] experts chosen on logits + σ·Gumbel noise from a seeded generator, weighed by the
                  family's rule on the clean logits (σ = 0 is exact routing)
  minconf:c       top-1 alone when its probability over all E (a softmax of the logits) is >= c, else K
  split:k:w       the top-k experts; the top-1 takes w of the combine, the other k-1 share 1-w in
                  proportion to their scores (split:3:0.9 is the essays' "top-3 at 90/10")
  cache:N[:q]     an LRU of N decisions keyed by the router input quantised to q × its RMS; a hit
                  reuses the cached experts and weights (N = 0 is exact routing)
  loadaware:Δ[:f[:decay]]  per step, experts loaded above capacity have their logits lowered by
                  Δ × relative excess, a penalty that carries to the next step × decay
  capacity:f:drop|reroute  per step at most capacity assignments per expert; the rest dropped
                  (weight 0) or moved to the token's next choice with room
  P+reset:N       a stateful policy P (ema, reuse, cache, loadaware) with its state cleared every N tokens

A "step" is what one decode step routes together: the batch's rows at one position (teacher-
forced scoring and prefill route each position's rows as a step). Capacity = max(1, ceil(f × B·K/E))
assignments per expert per step, B rows. Legend: B rows, T tokens per row, E experts, K per token, D hidden.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch
from torch import Tensor

from moekit.errors import MoekitError
from moekit.model.routing import (LayerState, PolicyStats, Reuse, RoutingDecision, Smooth, route, route_policy,
                                  route_rows, weights_for, with_k)
from moekit.spec.model_spec import RouterSpec


@dataclass(frozen=True)
class Temperature:
    """`temp:T`: the family's routing on logits / T: T < 1 sharpens the scores, T > 1 flattens them."""

    t: float

    def __str__(self) -> str:
        return f"temp:{self.t:g}"


@dataclass(frozen=True)
class Gumbel:
    """`gumbel:σ[:seed]`: choose on logits + σ·g, g ~ Gumbel(0, 1) from a generator seeded per layer;
    weigh the chosen by the family's rule on the clean logits."""

    sigma: float
    seed: Optional[int] = None  # None: the run's --seed where it has one, else 0

    def __str__(self) -> str:
        return f"gumbel:{self.sigma:g}" + (f":{self.seed}" if self.seed is not None else "")


@dataclass(frozen=True)
class MinConf:
    """`minconf:c`: the top-1 alone when its probability over all E experts is >= c, else all K."""

    c: float

    def __str__(self) -> str:
        return f"minconf:{self.c:g}"


@dataclass(frozen=True)
class Split:
    """`split:k:w`: the family's top-k; the top-1 carries w of the combine, the other k-1 share 1-w
    in proportion to their scores; × routed scaling."""

    k: int
    top: float

    def __str__(self) -> str:
        return f"split:{self.k}:{self.top:g}"


@dataclass(frozen=True)
class DecisionCache:
    """`cache:N[:q]`: an LRU of N routing decisions per layer, keyed by the router input rounded to
    q × its RMS; shared by the batch's rows, looked up in decode order (position, then row)."""

    size: int
    q: float = 0.5

    def __str__(self) -> str:
        return f"cache:{self.size}" + (f":{self.q:g}" if self.q != 0.5 else "")


@dataclass(frozen=True)
class LoadAware:
    """`loadaware:Δ[:f[:decay]]`: the essays' overload penalty (Δ = 0.8) at capacity factor f."""

    delta: float
    factor: float = 1.0
    decay: float = 0.5

    def __str__(self) -> str:
        return f"loadaware:{self.delta:g}:{self.factor:g}:{self.decay:g}"


@dataclass(frozen=True)
class Capacity:
    """`capacity:f:drop` or `capacity:f:reroute`: at most max(1, ceil(f·B·K/E)) assignments per
    expert per step, the highest-weighted first."""

    factor: float
    reroute: bool = False

    def __str__(self) -> str:
        return f"capacity:{self.factor:g}:{'reroute' if self.reroute else 'drop'}"


@dataclass(frozen=True)
class Reset:
    """`P+reset:N`: the stateful policy P with its per-layer state cleared every N tokens of a row."""

    every: int
    inner: Union[Smooth, Reuse, DecisionCache, LoadAware]

    def __str__(self) -> str:
        return f"{self.inner}+reset:{self.every}"


KNOBS = (Temperature, Gumbel, MinConf, Split, DecisionCache, LoadAware, Capacity, Reset)
STATEFUL = (Smooth, Reuse, DecisionCache, LoadAware)
# Policies whose decision for a token depends on the other rows of its step ("load in the current
# batch"): a server routes the rows of one step that share such a policy together, as one batch.
BATCH_LEVEL = (LoadAware, Capacity)


def is_batch_level(policy) -> bool:
    return isinstance(policy, BATCH_LEVEL)


def policy_width(policy, model_k: int) -> int:
    """Experts per token a policy's decision can hold: k for topk:k and split:k:w (above the
    model's K where asked), else the model's K."""
    from moekit.model.routing import TopK

    return policy.k if isinstance(policy, (TopK, Split)) else model_k


# --- parsing ---------------------------------------------------------------------------------


def _value(text: str, value: str, example: str, low: float, high: float = math.inf, low_open: bool = False) -> float:
    try:
        number = float(value)
    except ValueError:
        raise MoekitError(f"routing policy {text!r}: {value!r} is not a number (e.g. {example})") from None
    if not (low < number if low_open else low <= number) or not number <= high or number != number:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high != math.inf else f"{'above' if low_open else 'at least'} {low:g}"
        raise MoekitError(f"routing policy {text!r}: {value} must be {'in ' if high != math.inf else ''}{span} (e.g. {example})")
    return number


def _whole(text: str, value: str, example: str, low: int) -> int:
    if not value.strip().isdigit() or int(value) < low:
        raise MoekitError(f"routing policy {text!r}: {value!r} must be a whole number >= {low} (e.g. {example})")
    return int(value)


def parse_knob(text: str, name: str, value: str, model_k: int, num_experts: Optional[int]):
    """One knob from its name and the text after the first ':' ; None when the name is no knob."""
    args = value.split(":") if value else []
    if name == "temp" and len(args) == 1:
        return Temperature(_value(text, args[0], "temp:0.85", 0, low_open=True))
    if name == "gumbel" and len(args) in (1, 2):
        seed = _whole(text, args[1], "gumbel:0.2:7", 0) if len(args) == 2 else None
        return Gumbel(_value(text, args[0], "gumbel:0.2", 0), seed)
    if name == "minconf" and len(args) == 1:
        return MinConf(_value(text, args[0], "minconf:0.85", 0))
    if name == "split" and len(args) == 2:
        k = _whole(text, args[0], "split:3:0.9", 2)
        most = max(model_k, num_experts or model_k)
        if k > most:
            raise MoekitError(f"routing policy {text!r}: k must be 2..{most}")
        return Split(k, _value(text, args[1], "split:3:0.9", 0, 1))
    if name == "cache" and len(args) in (1, 2):
        q = _value(text, args[1], "cache:256:0.5", 0, low_open=True) if len(args) == 2 else 0.5
        return DecisionCache(_whole(text, args[0], "cache:256", 0), q)
    if name == "loadaware" and 1 <= len(args) <= 3:
        delta = _value(text, args[0], "loadaware:0.8", 0)
        factor = _value(text, args[1], "loadaware:0.8:1.25", 0, low_open=True) if len(args) > 1 else 1.0
        decay = _value(text, args[2], "loadaware:0.8:1.25:0.5", 0, 1) if len(args) > 2 else 0.5
        return LoadAware(delta, factor, decay)
    if name == "capacity" and len(args) == 2:
        if args[1] not in ("drop", "reroute"):
            raise MoekitError(f"routing policy {text!r}: overflow is 'drop' or 'reroute' (e.g. capacity:1.25:drop)")
        return Capacity(_value(text, args[0], "capacity:1.25:drop", 0, low_open=True), args[1] == "reroute")
    return None


def parse_combined(text: str, model_k: int, num_experts: Optional[int]) -> Reset:
    """'ema:0.95+reset:512' (either order) → Reset(512, Smooth(0.95))."""
    from moekit.model.routing import parse_policy

    parts = [p.strip().lower() for p in text.split("+")]
    resets = [p for p in parts if p.startswith("reset:")]
    others = [p for p in parts if not p.startswith("reset:")]
    if len(parts) != 2 or len(resets) != 1:
        raise MoekitError(f"routing policy {text!r}: '+' joins one stateful policy and reset:N (e.g. ema:0.95+reset:512)")
    every = _whole(text, resets[0].partition(":")[2], "reset:512", 1)
    inner = parse_policy(others[0], model_k, num_experts)
    if not isinstance(inner, STATEFUL):
        raise MoekitError(f"routing policy {text!r}: {inner} keeps no state to reset; reset:N goes with ema, reuse, "
                          "cache or loadaware")
    return Reset(every, inner)


# --- routing ---------------------------------------------------------------------------------


def route_knob(logits: Tensor, spec: RouterSpec, bias: Optional[Tensor], policy, state: LayerState, rows: int,
               inputs: Optional[Tensor], stats: PolicyStats) -> RoutingDecision:
    """logits [B*T, E] row-major → the knob's decision; counters added to `stats`."""
    logits = logits.float()
    if isinstance(policy, Reset):
        return _with_resets(logits, spec, bias, policy, state, rows, inputs, stats)
    stats.routed += logits.shape[0]
    if isinstance(policy, Temperature):
        return route(logits / policy.t, spec, bias)
    if isinstance(policy, Gumbel):
        return _gumbel(logits, spec, bias, policy, state)
    if isinstance(policy, MinConf):
        p1 = torch.softmax(logits, dim=-1).max(dim=-1).values  # [T]
        return route_rows(logits, spec, bias, torch.where(p1 >= policy.c, 1, spec.top_k).tolist())
    if isinstance(policy, Split):
        return _split(logits, spec, bias, policy)
    if isinstance(policy, DecisionCache):
        return _cached(logits, spec, bias, policy, state, rows, inputs, stats)
    if isinstance(policy, LoadAware):
        return _load_aware(logits, spec, bias, policy, state, rows, stats)
    return _capacity(logits, spec, bias, policy, rows, stats)


def _gumbel(logits: Tensor, spec: RouterSpec, bias: Optional[Tensor], policy: Gumbel, state: LayerState):
    if state.noise is None:
        # one stream per layer: the same seed gives the same noise whatever the batch's layer order
        state.noise = torch.Generator(device=logits.device).manual_seed((policy.seed or 0) * 1_000_003 + state.layer)
    u = torch.rand(logits.shape, generator=state.noise, device=logits.device).clamp(1e-20, 1 - 1e-7)
    noisy = logits + policy.sigma * -torch.log(-torch.log(u))  # [T, E]; σ = 0 leaves the logits bit for bit
    ids = route(noisy, spec, bias).topk_ids
    return RoutingDecision(topk_ids=ids, topk_weights=weights_for(logits, spec, ids))


def _split(logits: Tensor, spec: RouterSpec, bias: Optional[Tensor], policy: Split) -> RoutingDecision:
    chosen = route(logits, with_k(spec, policy.k), bias)
    rest = chosen.topk_weights[:, 1:]  # [T, k-1]
    shares = rest / rest.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    weights = torch.cat([torch.full_like(chosen.topk_weights[:, :1], policy.top), (1 - policy.top) * shares], dim=-1)
    return RoutingDecision(topk_ids=chosen.topk_ids, topk_weights=weights * spec.scaling)


def cache_keys(inputs: Tensor, q: float) -> list[bytes]:
    """inputs [T, D] → one key per token: the input rounded to steps of q × its RMS (scale-free)."""
    x = inputs.float()
    rms = x.pow(2).mean(dim=-1, keepdim=True).sqrt().clamp_min(1e-12)
    steps = torch.round(x / (q * rms)).clamp(-32768, 32767).to(torch.int16).cpu()  # [T, D]
    return [row.numpy().tobytes() for row in steps]


def _cached(logits, spec, bias, policy: DecisionCache, state: LayerState, rows: int, inputs, stats: PolicyStats):
    fresh = route(logits, spec, bias)
    if policy.size == 0:
        return fresh
    if inputs is None:
        raise MoekitError("cache:N keys on the router's input, which this caller does not pass")
    lru = state.decisions if state.decisions is not None else OrderedDict()
    state.decisions = lru
    ids, weights = fresh.topk_ids.clone(), fresh.topk_weights.clone()
    keys = cache_keys(inputs, policy.q)
    tokens = logits.shape[0] // rows
    for t in range(tokens):  # decode order: each position's rows, then the next position
        for r in range(rows):
            i, key = r * tokens + t, keys[r * tokens + t]
            stats.cache_lookups += 1
            hit = lru.get(key)
            if hit is not None:
                lru.move_to_end(key)
                stats.cache_hits += 1
                ids[i], weights[i] = hit
                continue
            lru[key] = (fresh.topk_ids[i], fresh.topk_weights[i])
            if len(lru) > policy.size:
                lru.popitem(last=False)
    return RoutingDecision(topk_ids=ids, topk_weights=weights)


def capacity_of(factor: float, rows: int, k: int, experts: int) -> int:
    """Assignments one expert takes in one step of `rows` tokens: f × the mean load, at least 1."""
    return max(1, math.ceil(factor * rows * k / experts))


def _steps(x: Tensor, rows: int) -> Tensor:
    """[B*T, ...] row-major → [T, B, ...]: one step (a position's rows) per leading index."""
    return x.view(rows, -1, *x.shape[1:]).transpose(0, 1)


def _unsteps(x: Tensor) -> Tensor:
    """[T, B, ...] → [B*T, ...] row-major."""
    return x.transpose(0, 1).reshape(-1, *x.shape[2:])


def _load_aware(logits, spec, bias, policy: LoadAware, state: LayerState, rows: int, stats: PolicyStats):
    experts = logits.shape[-1]
    exact = route(logits, spec, bias)
    cap = capacity_of(policy.factor, rows, exact.topk_ids.shape[1], experts)
    penalty = state.penalty if state.penalty is not None else torch.zeros(experts, device=logits.device)
    by_step, exact_ids = _steps(logits, rows), _steps(exact.topk_ids, rows)  # [T, B, E], [T, B, K]
    ids, weights = [], []
    for t in range(by_step.shape[0]):
        load = torch.bincount(exact_ids[t].reshape(-1), minlength=experts).float()  # [E]
        excess = (load - cap).clamp_min(0)
        stats.overflow += int(excess.sum())
        penalty = policy.decay * penalty + policy.delta * excess / cap
        step = route(by_step[t] - penalty, spec, bias)
        stats.penalised += int((step.topk_ids != exact_ids[t]).sum())
        ids.append(step.topk_ids)
        weights.append(step.topk_weights)
    state.penalty = penalty
    return RoutingDecision(topk_ids=_unsteps(torch.stack(ids)), topk_weights=_unsteps(torch.stack(weights)))


def ranking(logits: Tensor, spec: RouterSpec, bias: Optional[Tensor]) -> Tensor:
    """[T, E] every expert in the order the family would choose them (group limit lifted)."""
    return route(logits, replace(spec, top_k=spec.num_experts, topk_group=spec.n_group), bias).topk_ids


def assign_with_capacity(ids: list[list[int]], weights: list[list[float]], order: Optional[list[list[int]]],
                         cap: int) -> tuple[list[list[int]], list[list[bool]], int]:
    """One step's assignments → (ids after rerouting, kept flags, overflow): the highest-weighted
    assignments take their expert first while it has room; an assignment beyond capacity moves to
    the token's next expert in `order` with room that the token does not hold (reroute), or is
    dropped (order None, or no expert left with room)."""
    load: dict[int, int] = {}
    ids = [list(row) for row in ids]
    kept = [[False] * len(row) for row in ids]
    overflow = 0
    queue = sorted(((-w, b, j) for b, row in enumerate(weights) for j, w in enumerate(row)))
    for _, b, j in queue:
        e = ids[b][j]
        if load.get(e, 0) < cap:
            load[e] = load.get(e, 0) + 1
            kept[b][j] = True
            continue
        overflow += 1
        for other in order[b] if order is not None else ():
            if load.get(other, 0) < cap and other not in ids[b]:
                ids[b][j], kept[b][j] = other, True
                load[other] = load.get(other, 0) + 1
                break
    return ids, kept, overflow


def _capacity(logits, spec, bias, policy: Capacity, rows: int, stats: PolicyStats) -> RoutingDecision:
    exact = route(logits, spec, bias)
    cap = capacity_of(policy.factor, rows, exact.topk_ids.shape[1], logits.shape[-1])
    order = _steps(ranking(logits, spec, bias), rows).tolist() if policy.reroute else None
    step_ids, step_weights = _steps(exact.topk_ids, rows).tolist(), _steps(exact.topk_weights, rows).tolist()
    new_ids, new_kept = [], []
    for t in range(len(step_ids)):
        ids, kept, overflow = assign_with_capacity(step_ids[t], step_weights[t], order[t] if order else None, cap)
        stats.overflow += overflow
        new_ids.append(ids)
        new_kept.append(kept)
    ids = _unsteps(torch.tensor(new_ids, dtype=torch.int64, device=logits.device))  # [B*T, K]
    kept = _unsteps(torch.tensor(new_kept, dtype=torch.bool, device=logits.device))
    moved = (ids != exact.topk_ids) & kept
    stats.rerouted += int(moved.sum())
    stats.dropped += int((~kept).sum())
    weights = weights_for(logits, spec, ids) if bool(moved.any()) else exact.topk_weights
    # a dropped assignment reads the token's first kept expert at weight 0 (none: its own, at 0)
    first_kept = ids.gather(1, kept.float().argmax(dim=1, keepdim=True)).expand_as(ids)
    return RoutingDecision(topk_ids=torch.where(kept, ids, first_kept), topk_weights=weights * kept)


def _with_resets(logits, spec, bias, policy: Reset, state: LayerState, rows: int, inputs, stats: PolicyStats):
    """The inner policy over spans of positions that end where a row's token count reaches a
    multiple of N; the state is cleared at each such boundary."""
    tokens = logits.shape[0] // rows
    by_row = logits.view(rows, tokens, -1)  # [B, T, E]
    x = inputs.view(rows, tokens, -1) if inputs is not None else None  # [B, T, D]
    parts, t = [], 0
    while t < tokens:
        if state.seen > 0 and state.seen % policy.every == 0:
            state.clear()
            stats.resets += 1
        span = min(tokens - t, policy.every - state.seen % policy.every)
        part = route_policy(by_row[:, t : t + span].reshape(-1, by_row.shape[-1]), spec, bias, policy.inner, state, rows,
                            None if x is None else x[:, t : t + span].reshape(-1, x.shape[-1]), stats)
        parts.append(part)
        state.seen += span
        t += span
    width = max(p.topk_ids.shape[1] for p in parts)
    if any(p.topk_ids.shape[1] != width for p in parts):
        raise MoekitError(f"{policy}: spans routed to different widths")  # every stateful policy keeps K
    ids = torch.cat([p.topk_ids.view(rows, -1, width) for p in parts], dim=1)
    weights = torch.cat([p.topk_weights.view(rows, -1, width) for p in parts], dim=1)
    return RoutingDecision(topk_ids=ids.reshape(-1, width), topk_weights=weights.reshape(-1, width))
