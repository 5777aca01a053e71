"""`moekit placement`: plan which rank holds which expert, with redundant replicas, from a trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from moekit.errors import MoekitError

HELP = """Plan an expert placement from a routing trace: EPLB-style hierarchical balancing (pack experts to nodes, replicate the hottest, pack copies to ranks).

Writes a JSON file that `moekit run ... --expert-parallel N --placement FILE` loads, and prints the balancedness (mean ÷ max tokens per rank) of the even, in-order split against the plan, replaying the trace.

Examples:

  moekit placement trace.parquet --ranks 8 --redundant 8 --out placement.json

  moekit placement trace.parquet --ranks 2 --out placement.json --json
"""


def placement(
    trace: str = typer.Argument(..., metavar="TRACE.parquet", help="Routing trace written by `moekit run --trace`."),
    ranks: int = typer.Option(..., "--ranks", help="Ranks (GPUs or processes) to place the experts on."),
    redundant: Optional[int] = typer.Option(
        None, "--redundant", help="Extra physical experts per layer for replicas of hot ones; E + redundant must "
        "divide by --ranks. Default: the fewest that make it divide, at least one per rank."),
    ranks_per_node: int = typer.Option(8, "--ranks-per-node", help="Ranks per node (experts are packed to nodes first)."),
    groups: int = typer.Option(0, "--groups", help="Expert groups of the router (DeepSeek's n_group); 0: one per expert."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the placement JSON here."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    from moekit.dist.plan import default_redundant, eplb_placement, split_forwards
    from moekit.dist.simulate import read_forwards

    if out is not None and not out.parent.exists():
        raise MoekitError(f"--out {out}: folder {out.parent} does not exist")
    forwards = read_forwards(trace)
    experts = min(forwards.experts.values())
    if redundant is None:
        redundant = default_redundant(experts, ranks)
    plan = eplb_placement(forwards, ranks, redundant, ranks_per_node, groups)
    fit, held = split_forwards(forwards)
    scores = {"fitted": _balancedness(forwards, plan, ranks, experts),
              "held-out": _balancedness(held, eplb_placement(fit, ranks, redundant, ranks_per_node, groups), ranks, experts)}
    rows = {l: (scores["fitted"]["layers"][l], scores["held-out"]["layers"][l]) for l in sorted(scores["fitted"]["layers"])}
    overall = {name: {k: v for k, v in s.items() if k != "layers"} for name, s in scores.items()}
    doc = plan.to_json({"trace": str(trace), "balancedness": overall["fitted"], "balancedness_heldout": overall["held-out"],
                        "heldout_tokens": held.tokens, "balancedness_per_layer": {
                            str(l): {"linear": a["linear"], "plan": a["plan"], "heldout_linear": b["linear"],
                                     "heldout_plan": b["plan"]} for l, (a, b) in rows.items()}})
    if out is not None:
        out.write_text(json.dumps(doc, indent=1) + "\n")
    if as_json:
        typer.echo(json.dumps(doc))
        return
    _print_table(rows, overall, ranks, redundant, out, held.tokens, forwards.tokens)


def _balancedness(forwards, plan, ranks: int, experts: int) -> dict:
    """Mean ÷ max tokens per rank of PLAN and of the even, in-order split, on FORWARDS: per layer and overall."""
    from moekit.dist.placement import linear_placement
    from moekit.dist.simulate import Cost, simulate

    unit = Cost(row_bytes=1)
    planned = simulate(forwards, plan, unit)
    linear = simulate(forwards, linear_placement(forwards.experts, ranks), unit) if ranks <= experts else None
    layers = {l: {"linear": None if linear is None else linear[l].balancedness, "plan": planned[l].balancedness}
              for l in sorted(planned)}
    mean = lambda key: None if linear is None and key == "linear" else sum(v[key] for v in layers.values()) / len(layers)
    return {"linear": mean("linear"), "plan": mean("plan"), "layers": layers}


def _print_table(rows: dict, overall: dict, ranks: int, redundant: int, out: Optional[Path], held: int, tokens: int) -> None:
    from rich.console import Console
    from rich.table import Table

    def cell(x):
        return "—" if x is None else f"{x:.3f}"

    table = Table(title=f"balancedness (mean ÷ max tokens per rank), {ranks} ranks, {redundant} redundant experts per layer",
                  caption=f"fitted: the plan scored on the trace it was made from (all {tokens:,} tokens per layer); "
                          f"held-out: a plan made the same way from the first part, scored on the last {held:,} tokens",
                  caption_justify="left")
    for name in ("layer", "linear, fitted", "plan, fitted", "linear, held-out", "plan, held-out"):
        table.add_column(name, justify="right")
    for l, (a, b) in rows.items():
        table.add_row(str(l), cell(a["linear"]), cell(a["plan"]), cell(b["linear"]), cell(b["plan"]))
    fit, ho = overall["fitted"], overall["held-out"]
    table.add_row("all", cell(fit["linear"]), cell(fit["plan"]), cell(ho["linear"]), cell(ho["plan"]))
    console = Console()
    console.print(table)
    if fit["linear"] is None:
        console.print(f"note: linear needs at least one expert per rank; {ranks} ranks have fewer experts than ranks")
    if out is not None:
        console.print(f"placement -> {out}")
