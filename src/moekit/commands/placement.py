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
    from moekit.dist.placement import linear_placement
    from moekit.dist.plan import default_redundant, eplb_placement
    from moekit.dist.simulate import Cost, read_forwards, simulate

    if out is not None and not out.parent.exists():
        raise MoekitError(f"--out {out}: folder {out.parent} does not exist")
    forwards = read_forwards(trace)
    experts = min(forwards.experts.values())
    if redundant is None:
        redundant = default_redundant(experts, ranks)
    plan = eplb_placement(forwards, ranks, redundant, ranks_per_node, groups)
    unit = Cost(row_bytes=1)
    planned = simulate(forwards, plan, unit)
    linear = simulate(forwards, linear_placement(forwards.experts, ranks), unit) if ranks <= experts else None
    rows = {l: (None if linear is None else linear[l].balancedness, planned[l].balancedness) for l in sorted(planned)}
    overall = {"linear": None if linear is None else sum(r[0] for r in rows.values()) / len(rows),
               "plan": sum(r[1] for r in rows.values()) / len(rows)}
    doc = plan.to_json({"trace": str(trace), "balancedness": overall,
                        "balancedness_per_layer": {str(l): {"linear": a, "plan": b} for l, (a, b) in rows.items()}})
    if out is not None:
        out.write_text(json.dumps(doc, indent=1) + "\n")
    if as_json:
        typer.echo(json.dumps(doc))
        return
    _print_table(rows, overall, ranks, redundant, out)


def _print_table(rows: dict, overall: dict, ranks: int, redundant: int, out: Optional[Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    def cell(x):
        return "—" if x is None else f"{x:.3f}"

    table = Table(title=f"balancedness (mean ÷ max tokens per rank), {ranks} ranks, {redundant} redundant experts per layer")
    table.add_column("layer", justify="right")
    table.add_column("linear", justify="right")
    table.add_column("plan", justify="right")
    for l, (a, b) in rows.items():
        table.add_row(str(l), cell(a), cell(b))
    table.add_row("all", cell(overall["linear"]), cell(overall["plan"]))
    console = Console()
    console.print(table)
    if overall["linear"] is None:
        console.print(f"note: linear needs at least one expert per rank; {ranks} ranks have fewer experts than ranks")
    if out is not None:
        console.print(f"placement -> {out}")
