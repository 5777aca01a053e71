"""What an output token costs on a rented device, beside an API's price (no torch).

A device rented at P $/hour that decodes R output tokens/s costs P / 3600 / R × 10⁶ $ per million
output tokens. R comes from the roofline (`moekit calc --cost`: batch / step time, an upper bound)
or from a measured load (`moekit bench serve --price-per-hour`). Self-hosting breaks even at the
smallest batch whose $/M output tokens is at most the API's output price. Only decode is priced:
the prompt's prefill is compute-bound and short beside it at the batch sizes where the two meet,
and the API's input price is shown beside it for the reader to weigh their own prompt share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from moekit.errors import MoekitError


@dataclass(frozen=True)
class ApiPrice:
    """An API's list price, $ per million input and output tokens."""

    input_per_m: float
    output_per_m: float


def parse_price(text: str, what: str = "--price-per-hour") -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise MoekitError(f"{what} must be a price in dollars, e.g. 2.49; got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise MoekitError(f"{what} must be above 0, got {text!r}")
    return value


def parse_api_price(text: str) -> ApiPrice:
    """'IN,OUT' ($ per million input and output tokens) → ApiPrice."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2:
        raise MoekitError(f"--api-price is IN,OUT in $ per million tokens, e.g. 0.20,0.80; got {text!r}")
    return ApiPrice(parse_price(parts[0], "--api-price IN"), parse_price(parts[1], "--api-price OUT"))


def usd_per_million(price_per_hour: float, tokens_per_s: float) -> float:
    """$ per million tokens for a device at price_per_hour making tokens_per_s."""
    if tokens_per_s <= 0:
        return math.inf
    return price_per_hour / 3600.0 / tokens_per_s * 1e6


def break_even_batch(tokens_per_s_at: Callable[[int], float], price_per_hour: float, api_output_per_m: float,
                     largest: int) -> Optional[int]:
    """The smallest batch b in 1..largest whose cost per output token is within the API's, for a
    tokens_per_s_at(b) that grows with b; None when even `largest` (memory's limit) costs more."""
    def pays(b: int) -> bool:
        return usd_per_million(price_per_hour, tokens_per_s_at(b)) <= api_output_per_m

    if largest < 1 or not pays(largest):
        return None
    low, high = 0, largest  # pays(high); low is 0 or fails
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if pays(mid) else (mid, high)
    return high


@dataclass(frozen=True)
class Cost:
    source: str  # "roofline" or "measured"
    price_per_hour: float
    batch: int  # sequences decoded together (measured: the load's concurrency)
    tokens_per_s: float
    usd_per_m_output: float
    api: Optional[ApiPrice] = None
    break_even_batch: Optional[int] = None  # None: no batch pays (or no API price given)

    @property
    def api_ratio(self) -> Optional[float]:
        """Self-hosted over API cost per output token (below 1: self-hosting is cheaper)."""
        return None if self.api is None else self.usd_per_m_output / self.api.output_per_m

    def as_dict(self) -> dict:
        out = {"source": self.source, "price_per_hour": self.price_per_hour, "batch": self.batch,
               "tokens_per_s": self.tokens_per_s, "usd_per_m_output_tokens": self.usd_per_m_output}
        if self.api is not None:
            out["api"] = {"input_per_m": self.api.input_per_m, "output_per_m": self.api.output_per_m}
            out["self_over_api"] = self.api_ratio
            out["break_even_batch"] = self.break_even_batch
        return out

    def line(self) -> str:
        unit = "concurrency" if self.source == "measured" else "batch"  # a load level's clients, or the roofline's batch
        at = f", {unit} {self.batch}" if self.batch else ""
        text = (f"cost ({self.source}{at}): {self.tokens_per_s:,.1f} output tok/s at "
                f"${self.price_per_hour:g}/h = ${self.usd_per_m_output:,.4g} per million output tokens")
        if self.api is not None:
            even = (f"no {unit} {'measured' if self.source == 'measured' else 'that fits'} breaks even"
                    if self.break_even_batch is None else f"self-hosting breaks even at {unit} {self.break_even_batch}")
            text += (f"; API ${self.api.input_per_m:g} in / ${self.api.output_per_m:g} out per million: "
                     f"{self.api_ratio:.3g}× the API's output price; {even}")
        return text


def cost_at(source: str, price_per_hour: float, batch: int, tokens_per_s: float, api: Optional[ApiPrice] = None,
            break_even: Optional[int] = None) -> Cost:
    return Cost(source, price_per_hour, batch, tokens_per_s, usd_per_million(price_per_hour, tokens_per_s), api, break_even)


def measured_break_even(levels: list[tuple[int, float]], price_per_hour: float, api_output_per_m: float) -> Optional[int]:
    """(concurrency, measured output tok/s) of each load level → the smallest concurrency that pays."""
    paying = [c for c, rate in sorted(levels) if usd_per_million(price_per_hour, rate) <= api_output_per_m]
    return paying[0] if paying else None


def roofline_cost(report, price_per_hour: float, api: Optional[ApiPrice] = None) -> Cost:
    """A calc report's (with a roofline) cost at its batch, and the break-even batch up to the
    largest batch whose memory plan fits the devices."""
    from moekit.calc.report import step_at_batch
    from moekit.calc.roofline import largest_batch, step_bound

    roof = report.roofline
    if roof is None:
        raise MoekitError("--cost needs --hardware: the roofline is what prices a token")
    step_at = step_at_batch(report.spec, report.counts, report.request)

    def rate(batch: int) -> float:
        return step_bound(step_at(batch)[0], roof.flops_per_token, roof.bandwidth, roof.peak_flops).tokens_per_s

    even = None
    if api is not None:
        even = break_even_batch(rate, price_per_hour, api.output_per_m, largest_batch(lambda b: step_at(b)[1] <= roof.capacity_bytes))
    return cost_at("roofline", price_per_hour, roof.batched.batch, roof.batched.tokens_per_s, api, even)
