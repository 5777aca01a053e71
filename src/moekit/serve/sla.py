"""SLA tiers: each tier's latency targets and routing policy, admission that keeps them, goodput.

An operator sets, per tier (S, A, B), a time-to-first-token and an inter-token-latency target and
a routing policy: `--tier S=ttft:200ms,itl:50ms --tier A=ttft:2s,adaptive:0.85`. A request whose
estimated TTFT is over its tier's target is refused (429) or, with `--sla-action demote`, moved to
the next tier whose target it can meet (S → A → B), and refused only when none can.

The estimate is deliberately simple and stated: rows free up when running rows reach their
max_tokens (a stop token only frees them sooner), requests already waiting ahead take freed rows
first and hold them for their own max_tokens, and every decode step takes the measured mean step
time. The new request's first token then comes one step after it gets a row (its prefill).

Goodput (DistServe's sense): a finished request meets its tier's targets when its TTFT is within
the TTFT target and its mean inter-token latency (time per output token) within the ITL target;
attainment is met / finished, per tier that served it.
"""

from __future__ import annotations

import heapq
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from moekit.errors import MoekitError

TIER_ORDER = ("S", "A", "B")  # admission order, and the order of demotion
ACTIONS = ("reject", "demote")
_DURATION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(ms|s)$")


@dataclass(frozen=True)
class TierTargets:
    ttft_s: Optional[float] = None  # None: no target
    itl_s: Optional[float] = None
    routing: Optional[str] = None  # a routing policy (moekit.model.routing.parse_policy's forms)

    def met(self, ttft_s: Optional[float], itl_mean_s: Optional[float]) -> bool:
        if self.ttft_s is not None and (ttft_s is None or ttft_s > self.ttft_s):
            return False
        return self.itl_s is None or itl_mean_s is None or itl_mean_s <= self.itl_s


def parse_duration(text: str, what: str) -> float:
    """'200ms' or '1.5s' → seconds (a unit is required: a bare number is ambiguous)."""
    match = _DURATION.match(text.strip().lower())
    if match is None:
        raise MoekitError(f"{what}: {text!r} is not a duration (e.g. 200ms or 1.5s)")
    value = float(match.group(1))
    return value / 1000 if match.group(2) == "ms" else value


def parse_tiers(options: Sequence[str]) -> dict[str, TierTargets]:
    """`--tier` values ('S=ttft:200ms,itl:50ms', 'A=adaptive:0.85', …) → targets per tier; several
    `--tier` of one tier add up. Items other than ttft:/itl: are the tier's routing policy."""
    fields: dict[str, dict] = {}
    for option in options:
        name, sep, rest = option.partition("=")
        name = name.strip().upper()
        if not sep or name not in TIER_ORDER or not rest.strip():
            raise MoekitError(f"--tier {option!r}: expected TIER=ITEM[,ITEM…] with TIER one of {', '.join(TIER_ORDER)}, "
                              "e.g. S=ttft:200ms,itl:50ms or A=adaptive:0.85")
        tier = fields.setdefault(name, {})
        for item in rest.split(","):
            key, _, value = item.strip().partition(":")
            if key.lower() in ("ttft", "itl"):
                tier[f"{key.lower()}_s"] = parse_duration(value, f"--tier {name} {key.lower()}")
            elif "routing" in tier:
                raise MoekitError(f"--tier {option!r}: tier {name} has two routing policies ({tier['routing']}, {item.strip()})")
            else:
                tier["routing"] = item.strip()
    return {name: TierTargets(**f) for name, f in fields.items()}


def estimate_start_steps(running_left: Sequence[int], max_batch: int, ahead: Sequence[int]) -> int:
    """Decode steps until a new request gets a row.

    running_left: tokens each running row has left (to its max_tokens); ahead: max_tokens of each
    waiting request admitted before it, in order. Each freed row goes to the next waiting request."""
    free_at = list(running_left) + [0] * max(max_batch - len(running_left), 0)
    heapq.heapify(free_at)
    for tokens in ahead:
        heapq.heappush(free_at, heapq.heappop(free_at) + tokens)
    return heapq.heappop(free_at) if free_at else 0


@dataclass
class Load:
    """What admission reads of the scheduler: rows running and requests waiting, by tier."""

    max_batch: int
    running_left: list[int]
    waiting: dict[str, list[int]]  # tier -> max_tokens of its waiting requests, in order

    def ahead_of(self, tier: str) -> list[int]:
        """The waiting requests admitted before a new one of `tier` (higher tiers, then its own)."""
        out: list[int] = []
        for name in TIER_ORDER[: TIER_ORDER.index(tier) + 1]:
            out += self.waiting.get(name, [])
        return out


def load_of(scheduler) -> Load:
    """A snapshot of the scheduler's rows and queues (read from another thread: counts only)."""
    rows = list(scheduler.rows)
    waiting = {tier: [r.max_new_tokens for r in list(q)] for tier, q in scheduler.waiting.items()}
    return Load(scheduler.max_batch, [max(r.request.max_new_tokens - len(r.tokens), 0) for r in rows], waiting)


@dataclass(frozen=True)
class Decision:
    tier: Optional[str]  # where the request goes; None: refused
    estimate_s: Optional[float]  # the estimated TTFT in that tier (or in the first tier tried)
    reason: str = ""


@dataclass
class Admission:
    """Admission under the tiers' TTFT targets. clock() gives seconds (time.perf_counter by default;
    tests pass their own): step-time measurements older than `memory_s` are forgotten, so a server
    that idled does not judge new requests by a burst long past."""

    tiers: dict[str, TierTargets]
    action: str = "reject"
    clock: Callable[[], float] = time.perf_counter
    memory_s: float = 30.0
    alpha: float = 0.2  # weight of the newest step in the moving mean
    _step_s: Optional[float] = None
    _measured_at: float = 0.0

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise MoekitError(f"--sla-action must be one of {', '.join(ACTIONS)}, got {self.action!r}")

    def step_done(self, seconds: float) -> None:
        """One decode step (with rows) took `seconds`."""
        now = self.clock()
        if self._step_s is None or now - self._measured_at > self.memory_s:
            self._step_s = seconds
        else:
            self._step_s = (1 - self.alpha) * self._step_s + self.alpha * seconds
        self._measured_at = now

    @property
    def step_s(self) -> Optional[float]:
        if self._step_s is None or self.clock() - self._measured_at > self.memory_s:
            return None
        return self._step_s

    def estimate_ttft_s(self, tier: str, load: Load) -> Optional[float]:
        step = self.step_s
        if step is None:
            return None  # nothing measured yet: admit
        return (estimate_start_steps(load.running_left, load.max_batch, load.ahead_of(tier)) + 1) * step

    def decide(self, tier: str, load: Load) -> Decision:
        """The tier the request runs in, or None (429), by its tier's TTFT target."""
        first = self.estimate_ttft_s(tier, load)
        candidates = TIER_ORDER[TIER_ORDER.index(tier):] if self.action == "demote" else (tier,)
        for name in candidates:
            estimate = self.estimate_ttft_s(name, load)
            target = self.tiers.get(name, TierTargets()).ttft_s
            if target is None or estimate is None or estimate <= target:
                return Decision(name, estimate)
        target = self.tiers[tier].ttft_s
        return Decision(None, first, f"tier {tier}'s time-to-first-token target is {target * 1000:g} ms and the "
                                     f"estimated wait is {first * 1000:.0f} ms; retry later"
                        + (" (no lower tier meets its own target either)" if self.action == "demote" else ""))


@dataclass
class Goodput:
    """Per tier: requests finished, those that met the tier's targets, refused and demoted."""

    tiers: dict[str, TierTargets]
    finished: dict[str, int] = field(default_factory=dict)
    met: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    demoted: dict[tuple[str, str], int] = field(default_factory=dict)

    def observe(self, tier: str, submitted_at: float, token_times: Sequence[float]) -> bool:
        ttft = token_times[0] - submitted_at if token_times else None
        gaps = len(token_times) - 1
        itl = (token_times[-1] - token_times[0]) / gaps if gaps > 0 else None
        ok = self.tiers.get(tier, TierTargets()).met(ttft, itl)
        self.finished[tier] = self.finished.get(tier, 0) + 1
        self.met[tier] = self.met.get(tier, 0) + int(ok)
        return ok

    def decided(self, asked: str, decision: Decision) -> None:
        if decision.tier is None:
            self.rejected[asked] = self.rejected.get(asked, 0) + 1
        elif decision.tier != asked:
            self.demoted[(asked, decision.tier)] = self.demoted.get((asked, decision.tier), 0) + 1

    def attainment(self, tier: str) -> Optional[float]:
        n = self.finished.get(tier, 0)
        return self.met.get(tier, 0) / n if n else None


class GoodputCollector:
    """moekit:tier_* metrics, read from a Goodput when Prometheus scrapes."""

    def __init__(self, goodput: Goodput):
        self.goodput = goodput

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        g = self.goodput
        finished = CounterMetricFamily("moekit:tier_requests_finished", "Requests finished, by the tier that served them.", labels=["tier"])
        met = CounterMetricFamily("moekit:tier_requests_met_slo", "Finished requests within their tier's TTFT and mean ITL targets (goodput).", labels=["tier"])
        attain = GaugeMetricFamily("moekit:tier_slo_attainment", "Share of a tier's finished requests that met its targets.", labels=["tier"])
        rejected = CounterMetricFamily("moekit:tier_requests_rejected", "Requests refused (429) because their tier's TTFT target could not be met.", labels=["tier"])
        demoted = CounterMetricFamily("moekit:tier_requests_demoted", "Requests moved to a lower tier to meet a TTFT target.", labels=["from_tier", "to_tier"])
        targets = GaugeMetricFamily("moekit:tier_target_seconds", "Each tier's latency targets.", labels=["tier", "target"])
        for tier in TIER_ORDER:
            finished.add_metric([tier], g.finished.get(tier, 0))
            met.add_metric([tier], g.met.get(tier, 0))
            rejected.add_metric([tier], g.rejected.get(tier, 0))
            share = g.attainment(tier)
            if share is not None:
                attain.add_metric([tier], share)
            t = g.tiers.get(tier)
            for name, value in (("ttft", t and t.ttft_s), ("itl", t and t.itl_s)):
                if value is not None:
                    targets.add_metric([tier, name], value)
        for (asked, to), n in g.demoted.items():
            demoted.add_metric([asked, to], n)
        yield from (finished, met, attain, rejected, demoted, targets)


@dataclass
class TierControl:
    """A server's tiers: targets and policies, admission and goodput (one per server, no globals)."""

    tiers: dict[str, TierTargets]
    admission: Admission
    goodput: Goodput

    @classmethod
    def build(cls, tiers: dict[str, TierTargets], action: str = "reject", clock: Callable[[], float] = time.perf_counter):
        return cls(tiers, Admission(tiers, action, clock), Goodput(tiers))

    @property
    def has_targets(self) -> bool:
        return any(t.ttft_s is not None for t in self.tiers.values())

    def routing(self, tier: str) -> Optional[str]:
        return self.tiers.get(tier, TierTargets()).routing

    def place(self, tier: str, scheduler) -> Decision:
        """The tier a new request runs in (its own when no target applies), counted in the goodput."""
        if not self.has_targets:
            return Decision(tier, None)
        decision = self.admission.decide(tier, load_of(scheduler))
        self.goodput.decided(tier, decision)
        return decision
