"""`moekit bench serve URL`: load an OpenAI-compatible server and report throughput and latency."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer

from moekit.errors import MoekitError

HELP = """Load any OpenAI-compatible /v1/completions endpoint (moekit serve, llama-server, vLLM) and report output tokens/s, TTFT, ITL and end-to-end latency at p50/p90/p99.

Every request streams exactly --max-tokens tokens (greedy, ignore_eos). Load is a sweep of concurrencies (N clients, each sending its next request when its last one ends) or an open-loop request rate. For moekit the mean active share comes from usage.moe.

  moekit bench serve http://127.0.0.1:8000 --concurrency 1,4,16 --requests 64
  moekit bench serve http://127.0.0.1:8080 --random-ids 32 --vocab 32000 --max-tokens 64 --json   # llama-server
  moekit bench serve http://127.0.0.1:8000 --rate 4 --requests 100 --tier B
  moekit bench serve http://127.0.0.1:8000 --concurrency 16 --routing capacity:1:drop
  moekit bench serve http://127.0.0.1:8000 --concurrency 1,4,16 --price-per-hour 0.10 --api-price 0.20,0.80
"""


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise MoekitError(f"{name}: expected comma-separated integers like 1,4,16, got {text!r}") from None
    if not values or min(values) < 1:
        raise MoekitError(f"{name}: give one or more integers >= 1, got {text!r}")
    return values


def _moe(tier: Optional[str], routing: Optional[str]) -> dict:
    """The body's "moe" object for --tier and --routing (the server checks the policy: a 400 names it)."""
    moe = {key: value for key, value in (("tier", tier), ("routing", routing)) if value}
    return {"moe": moe} if moe else {}


def serve(
    url: str = typer.Argument(..., help="The server's base URL, e.g. http://127.0.0.1:8000 (with or without /v1)."),
    concurrency: str = typer.Option("1,4,16", "--concurrency", help="Comma-separated client counts, one load level each."),
    rate: Optional[float] = typer.Option(None, "--rate", help="Requests/s, Poisson arrivals, instead of --concurrency."),
    requests: int = typer.Option(64, "--requests", help="Requests per load level."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Output tokens per request (fixed: ignore_eos)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="One prompt per line, or JSONL with \"prompt\" (text or ids)."),
    random_ids: Optional[int] = typer.Option(None, "--random-ids", help="Random token-id prompts of this length (the same for every server)."),
    vocab: int = typer.Option(1000, "--vocab", help="Random ids are drawn from 1..vocab-1."),
    tier: Optional[str] = typer.Option(None, "--tier", help="moekit's expert-budget tier for every request: S, A or B."),
    routing: Optional[str] = typer.Option(None, "--routing", help="moekit's routing policy for every request "
                                          "(\"moe\": {\"routing\": P}), e.g. capacity:1:drop."),
    model: Optional[str] = typer.Option(None, "--model", help="Model id to send. Default: the first one /v1/models lists."),
    warmup: int = typer.Option(2, "--warmup", help="Requests sent before each level, not counted."),
    seed: int = typer.Option(0, "--seed", help="Seed for random prompts and arrivals."),
    price_per_hour: Optional[str] = typer.Option(None, "--price-per-hour", metavar="USD",
                                                 help="The serving machine's hourly price: $ per million output tokens at each load level."),
    api_price: Optional[str] = typer.Option(None, "--api-price", metavar="IN,OUT",
                                            help="An API's $ per million input and output tokens, to compare (needs --price-per-hour)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
) -> None:
    from rich.console import Console
    from rich.progress import Progress

    from moekit.bench.serve import LoadPlan, first_model, load_prompts, run_level

    levels = _ints(concurrency, "--concurrency") if rate is None else [None]
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise MoekitError(f"--rate must be a positive number of requests/s, got {rate}")
    if requests < 1 or max_tokens < 1 or warmup < 0:
        raise MoekitError("--requests and --max-tokens must be at least 1, --warmup at least 0")
    if tier is not None and tier not in ("S", "A", "B"):
        raise MoekitError(f"--tier must be S, A or B, got {tier!r}")
    priced = _prices(price_per_hour, api_price)
    texts = load_prompts(prompts, random_ids, vocab, max(requests, 1), seed)
    plan = LoadPlan(url=url, prompts=texts, max_tokens=max_tokens, model=model or first_model(url),
                    extra=_moe(tier, routing))
    results = []
    with Progress(transient=True, disable=json_out) as bar:
        for level in levels:
            name = f"rate {rate}/s" if level is None else f"concurrency {level}"
            task = bar.add_task(name, total=requests)
            results.append(run_level(plan, requests, concurrency=level, rate=rate, seed=seed,
                                     progress=lambda: bar.advance(task), warmup=warmup))
    costs = _costs(results, priced) if priced is not None else []
    if json_out:
        levels = [r.as_dict() for r in results]
        for level, cost in zip(levels, costs):
            level["cost"] = cost.as_dict()
        typer.echo(json.dumps({"url": url, "model": plan.model, "max_tokens": max_tokens, "levels": levels}, indent=2))
        return
    Console().print(_table(results, plan))
    for cost in costs:
        typer.echo(cost.line())


def _prices(price_per_hour: Optional[str], api_price: Optional[str]):
    from moekit.calc.cost import parse_api_price, parse_price

    if price_per_hour is None:
        if api_price is not None:
            raise MoekitError("--api-price needs --price-per-hour (the serving machine's price)")
        return None
    return parse_price(price_per_hour), None if api_price is None else parse_api_price(api_price)


def _costs(results, priced) -> list:
    """Each load level's measured cost; the break-even is the smallest measured concurrency that pays."""
    from moekit.calc.cost import cost_at, measured_break_even

    price, api = priced
    levels = [(r.concurrency, r.output_tok_s) for r in results if r.concurrency is not None]
    even = measured_break_even(levels, price, api.output_per_m) if api is not None else None
    return [cost_at("measured", price, r.concurrency or 0, r.output_tok_s, api, even) for r in results]


def _table(results, plan):
    from rich.table import Table

    def ms(d, key):
        v = d[key]
        return "—" if v != v else f"{v * 1000:.0f}"

    table = Table(title=f"{plan.completions_url} · {plan.model} · {plan.max_tokens} tokens per request")
    for name in ("load", "requests", "errors", "output tok/s", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms",
                 "e2e p50/p99 ms", "active share"):
        table.add_column(name, justify="right")
    for r in results:
        load = f"{r.rate}/s" if r.concurrency is None else f"c={r.concurrency}"
        table.add_row(
            load, str(r.requests), str(r.errors), f"{r.output_tok_s:.1f}",
            "/".join(ms(r.ttft_s, k) for k in ("p50", "p90", "p99")),
            "/".join(ms(r.itl_s, k) for k in ("p50", "p90", "p99")),
            "/".join(ms(r.e2e_s, k) for k in ("p50", "p99")),
            "—" if r.mean_active_share is None else f"{r.mean_active_share:.2%}",
        )
    if any(r.errors for r in results):
        table.caption = "first error: " + next(r.first_error for r in results if r.errors)
    return table
