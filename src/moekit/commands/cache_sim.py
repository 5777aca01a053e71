"""`moekit cache-sim`: expert-cache hit rates per policy × slots, replayed from a routing trace."""

from __future__ import annotations

import json
from typing import Optional

import typer

HELP = """Size an expert cache without running the model: replay a routing trace (from `moekit run ... --trace t.parquet`) through each policy and slot count.

Each MoE layer keeps SLOTS experts; every forward (the prefill, then each decode step) uses the distinct experts its tokens chose. Reports hit rates overall, at decode and per layer, the prompt's misses apart from the decode's (per decoded token, at most K per MoE layer) and evictions. `belady` knows the future: the best any policy could do. A live `moekit run --expert-memory` without prefetch gets the same hit rate at the same slots: a share (25%) is of the model's experts per layer, which the trace records, rounded down as the live store rounds it.

Examples:

  moekit cache-sim t.parquet

  moekit cache-sim t.parquet --policy lru,lfu --slots 4,8,16

  moekit cache-sim t.parquet --slots 25%,50% --pin profile.json --json
"""


def cache_sim(
    trace: str = typer.Argument(..., metavar="TRACE.parquet", help="Routing trace written by `moekit run --trace`."),
    policy: str = typer.Option(
        "lru,lfu,lfu-aging,lfru,belady", "--policy", metavar="NAMES", help="Comma-separated: lru, lfu, lfu-aging, lfru, belady."
    ),
    slots: str = typer.Option(
        "25%,50%",
        "--slots",
        metavar="N,...",
        help="Experts resident per MoE layer: counts (4,8,16) or shares of the experts (25%), comma-separated.",
    ),
    pin: Optional[str] = typer.Option(
        None, "--pin", metavar="PROFILE.json", help='Pin the experts of a profile\'s "pins" (never evicted).'
    ),
    num_experts: Optional[int] = typer.Option(
        None, "--num-experts", metavar="E",
        help="Routed experts per layer, for a trace that does not record them (written by an older moekit). "
             "Default: the trace's own.",
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of tables."),
) -> None:
    from moekit.analysis import cache_sim as sim

    policies = sim.parse_policies(policy)
    calls = sim.read_trace(trace)
    pins = sim.read_pins(pin) if pin else {}
    experts = sim.check_request(calls, num_experts, pins)
    notes: list[str] = []
    request = sim.SimRequest(policies, sim.parse_slots(slots, experts, notes), experts, pins, pin, tuple(notes))
    report = sim.run_cache_sim(calls, request)
    report["trace"] = trace
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    from rich.console import Console

    console = Console(width=max(100, Console().width))
    console.print(_summary_table(report))
    console.print(_layer_table(report))
    for note in report["notes"]:
        console.print(f"note: {note}")


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1%}"


def _summary_table(report: dict):
    from rich.table import Table

    model = f" ({report['model']['model']})" if report["model"] else ""
    experts = "? experts" if report["num_experts"] is None else f"{report['num_experts']} experts"
    title = (
        f"{report['trace']}{model}: {report['trace_rows']:,} rows, "
        f"{len(report['layers'])} MoE layers × {experts}, {report['generated_tokens']:,} generated tokens"
    )
    table = Table(title=title)
    bound = report["max_misses_per_decoded_token"]
    table.caption = ("prefill misses: the prompt's forward, counted once. decode miss/token: misses of the decode "
                     "steps per decoded token" + (f" (at most {bound}: K experts in each MoE layer)" if bound else ""))
    table.caption_justify = "left"
    for name in ("policy", "slots", "share", "pinned", "hit rate", "decode hit", "prefill misses", "decode miss/token",
                 "evictions"):
        table.add_column(name, justify="left" if name == "policy" else "right", no_wrap=True)
    for r in report["results"]:
        table.add_row(
            r["policy"],
            str(r["slots"]),
            "-" if r["slots_share"] is None else f"{r['slots_share']:.0%}",
            str(r["pinned"]),
            _pct(r["hit_rate"]),
            _pct(r["decode_hit_rate"]),
            f"{r['prefill_misses']:,}",
            "-" if r["decode_misses_per_token"] is None else f"{r['decode_misses_per_token']:.2f}",
            f"{r['evictions']:,}",
        )
    return table


def _layer_table(report: dict):
    """One row per policy × slots; the layers wrap inside a cell, so 60 layers still read."""
    from rich.table import Table

    table = Table(title="hit rate per layer (layer:rate)")
    table.add_column("policy", no_wrap=True)
    table.add_column("slots", justify="right", no_wrap=True)
    table.add_column("per layer")
    for r in report["results"]:
        cells = [f"{layer}:{_pct(r['layers'][str(layer)]['hit_rate'])}" for layer in report["layers"]]
        table.add_row(r["policy"], str(r["slots"]), "  ".join(cells))
    return table
