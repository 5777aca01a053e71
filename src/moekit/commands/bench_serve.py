"""`moekit bench serve URL`: load an OpenAI-compatible server and report throughput and latency;
`moekit bench serve CKPT --vs llama-server,vllm`: start moekit and each peer on the checkpoint, in turn."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
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

Given a checkpoint folder instead of a URL, it starts the servers itself, one at a time on a free loopback port: `moekit serve` (with --moekit-args) and each --vs baseline on the same checkpoint, dtype, --threads and --max-batch, the same workload for each (c clients sending --per-client x c streamed completions (4 x c) of --random-ids-token id prompts, default 8, at each --concurrency; then the largest c again with --arrivals prompts of --arrival-tokens ids arriving during it), and prints each engine's output tok/s (TTFT p50, ITL p50/p99 ms) and moekit's ratio to each baseline from the same run. --rounds N runs everything N times, the engines' order rotated each round; figures are ranges over rounds.

  moekit bench serve path/to/checkpoint --vs llama-server,vllm                 # benchmarks/build_llama_cpp.sh, build_vllm_cpu.sh first
  moekit bench serve path/to/checkpoint --vs llama-server,moekit:--eager --dtype bf16 --rounds 2
  moekit bench serve path/to/checkpoint --vs llama-server --weights int8       # against its q8_0 GGUF
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
    url: str = typer.Argument(..., metavar="URL_OR_CHECKPOINT", help="The server's base URL, e.g. http://127.0.0.1:8000 "
                              "(with or without /v1), or a checkpoint folder to start the servers on (with --vs)."),
    concurrency: str = typer.Option("1,4,16", "--concurrency", help="Comma-separated client counts, one load level each."),
    rate: Optional[float] = typer.Option(None, "--rate", help="Requests/s, Poisson arrivals, instead of --concurrency."),
    requests: Optional[int] = typer.Option(None, "--requests", help="Requests per load level (against a URL; "
                                           "default 64). Against a checkpoint each level sends 4 x c."),
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
    vs: Optional[str] = typer.Option(None, "--vs", help="With a checkpoint: baselines started on it, comma-separated: "
                                     "llama-server, vllm, moekit:FLAGS (another moekit serve, e.g. moekit:--eager)."),
    per_client: int = typer.Option(4, "--per-client", help="With a checkpoint: requests per client at each level (c x N)."),
    dtype: str = typer.Option("float32", "--dtype", help="With a checkpoint: every engine's dtype, float32 or bfloat16."),
    weights: str = typer.Option("dtype", "--weights", help="With a checkpoint: moekit's --weights (int8 runs "
                                "llama-server on q8_0; vLLM has no like form)."),
    threads: int = typer.Option(2, "--threads", help="With a checkpoint: threads of every engine."),
    max_batch: int = typer.Option(16, "--max-batch", help="With a checkpoint: rows decoded together by every engine "
                                  "(--max-batch / -np / --max-num-seqs)."),
    moekit_args: str = typer.Option("", "--moekit-args", help="With a checkpoint: more `moekit serve` flags for the "
                                    "subject, e.g. \"--eager\" (the eager step; the default is the compiled one)."),
    arrivals: int = typer.Option(4, "--arrivals", help="With a checkpoint: long prompts arriving during a level at the "
                                 "largest --concurrency (0: no such level)."),
    arrival_tokens: int = typer.Option(512, "--arrival-tokens", help="With a checkpoint: the arriving prompts' length in ids."),
    rounds: int = typer.Option(1, "--rounds", help="With a checkpoint: runs of every engine, their order rotated each round."),
) -> None:
    from rich.console import Console
    from rich.progress import Progress

    from moekit.bench.serve import LoadPlan, first_model, load_prompts, run_level

    if Path(url).is_dir() or vs is not None:
        if (rate is not None or requests is not None or prompts is not None or tier or routing or price_per_hour
                or api_price or model):
            raise MoekitError("with a checkpoint the workload is fixed (--per-client x c requests a level): --rate, --requests, "
                              "--prompts, --tier, --routing, --model and prices apply to a URL only")
        _peers(Path(url), vs or "", _ints(concurrency, "--concurrency"), max_tokens, random_ids, warmup, seed,
               dtype, weights, threads, max_batch, moekit_args, arrivals, arrival_tokens, rounds, per_client, json_out)
        return
    requests = 64 if requests is None else requests
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


def _peers(checkpoint: Path, vs: str, levels: list[int], max_tokens: int,
           prompt_len: Optional[int], warmup: int, seed: int, dtype: str, weights: str, threads: int, max_batch: int,
           moekit_args: str, arrivals: int, arrival_tokens: int, rounds: int, per_client: int, json_out: bool) -> None:
    import signal
    import sys

    from moekit.bench.serve_peers import ServeSetup, Workload, markdown_table, parse_vs, ratio_rows, run_peers

    # SIGTERM unwinds like Ctrl-C, so the server this run started is stopped too, not orphaned.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    if not ((checkpoint / "config.json").is_file() or (checkpoint.suffix == ".gguf" and checkpoint.is_file())):
        raise MoekitError(f"{checkpoint}: --vs needs a checkpoint folder (with config.json) or a .gguf file, not a URL")
    if threads < 1 or max_batch < 1 or warmup < 0:
        raise MoekitError("--threads and --max-batch must be at least 1, --warmup at least 0")
    workload = Workload(prompt_len=prompt_len or 8, max_tokens=max_tokens, requests_per_client=per_client,
                        concurrency=tuple(levels), arrival_prompt_len=arrival_tokens, arrival_count=arrivals,
                        arrival_concurrency=max(levels),
                        warmup=warmup, seed=seed)
    engines = parse_vs(vs, moekit_args)
    setup = ServeSetup(checkpoint, dtype, weights, threads, max_batch)
    say = (lambda line: typer.echo(line, err=True)) if json_out else typer.echo  # stdout stays one JSON object
    results = run_peers(engines, setup, workload, rounds, progress=say)
    if json_out:
        typer.echo(json.dumps({"checkpoint": str(checkpoint), "setup": {"dtype": dtype, "weights": weights,
                               "threads": threads, "max_batch": max_batch, "moekit_args": moekit_args},
                               "workload": asdict(workload),
                               "rounds": [{k: v.as_dict() for k, v in r.items()} for r in results]}, indent=2))
        return
    typer.echo(f"\n{checkpoint} · {dtype} · weights {weights} · {threads} threads · {rounds} round(s); "
               "output tok/s (TTFT p50 ms, ITL p50/p99 ms):\n")
    typer.echo(markdown_table(ratio_rows(results)))
    for round_runs in results:
        for run in round_runs.values():
            if run.failed:
                typer.echo(f"{run.engine} failed: {run.failed}")
            if run.note:
                typer.echo(f"{run.engine}: {run.note}")
            if run.arrivals is not None:
                typer.echo(f"{run.engine}: the {run.arrivals.requests} arrivals' TTFT p50 "
                           f"{run.arrivals.ttft_s['p50'] * 1e3:.0f} ms, errors {run.arrivals.errors}")


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
