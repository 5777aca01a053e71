"""`moekit simulate`: replay a routing trace through placements at 8-256 ranks, without the model."""

from __future__ import annotations

import json
from typing import Optional

import typer

from moekit.errors import MoekitError

HELP = """Replay a routing trace through an expert placement at many ranks (nodes of 8), without running the model.

Per rank count: balancedness (mean ÷ max tokens per rank), all-to-all bytes per token (dispatch + combine, within and between nodes, at --dtype), and with --hardware an estimated MoE time per forward. Without --placement it compares the even, in-order split (linear) with an EPLB plan made from the same trace.

Examples:

  moekit simulate trace.parquet --ranks 8,16,64,256 --hardware h100

  moekit simulate trace.parquet --placement placement.json --hardware h100

  moekit simulate --uniform deepseek-v3 --tokens 256 --ranks 8,16,64,256 --hardware h100   # a uniform router
"""


def _ranks(text: str) -> list[int]:
    values = [p.strip() for p in text.split(",") if p.strip()]
    if not values or not all(v.isdigit() and int(v) > 0 for v in values):
        raise MoekitError(f"--ranks: expected comma-separated positive rank counts like 8,16,64, got {text!r}")
    return [int(v) for v in values]


def simulate(
    trace: Optional[str] = typer.Argument(None, metavar="TRACE.parquet", help="Routing trace from `moekit run --trace`."),
    ranks: str = typer.Option("8,16,64,256", "--ranks", metavar="N,...", help="Rank counts to simulate."),
    placement_file: Optional[str] = typer.Option(None, "--placement", help="A `moekit placement` plan (its rank count only)."),
    redundant: Optional[int] = typer.Option(None, "--redundant", help="Redundant experts of the EPLB plan "
                                            "(default: the fewest that divide, at least one per rank)."),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="Catalog GPU for the time estimate (h100, h200, a100, b200, mi300x)."),
    model: Optional[str] = typer.Option(None, "--model", help="Checkpoint, config.json or preset: hidden size and expert "
                                        "size (default: the bundled model when the trace is its)."),
    dtype: str = typer.Option("bf16", "--dtype", help="Values on the wire and in the experts: fp32, bf16 or fp8 (also spelt float32, bfloat16)."),
    uniform: Optional[str] = typer.Option(None, "--uniform", metavar="MODEL", help="No trace: a uniform router on this "
                                          "model's shape (a preset such as deepseek-v3, or a config)."),
    tokens: int = typer.Option(256, "--tokens", help="With --uniform: tokens per forward (the global batch)."),
    forwards: int = typer.Option(8, "--forwards", help="With --uniform: forwards per layer."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    wide: bool = typer.Option(False, "--wide", help="Every column, whatever the terminal's width (default: what fits)."),
) -> None:
    from moekit.dist.costs import check_dtype

    dtype = check_dtype(dtype)
    counts = _ranks(ranks)
    fwd, facts, name = _load(trace, uniform, model, tokens, forwards)
    from moekit.dist.costs import make_cost

    d, expert_params, _, _, groups = facts
    cost = make_cost(d, expert_params, dtype, hardware)
    results = _runs(fwd, counts, placement_file, redundant, groups, cost)
    doc = {"trace": trace or f"uniform:{uniform}", "model": name, "dtype": dtype, "hardware": hardware,
           "tokens": fwd.tokens, "results": results}
    if as_json:
        typer.echo(json.dumps(doc))
        return
    _print(doc, wide)


def _load(trace, uniform, model, tokens, forwards):
    """(forwards, spec_facts' tuple, model name): --model's shapes when given, else the ones the
    trace records (moekit writes them), else the bundled model's when the trace is its."""
    from moekit.dist.costs import bundled_model_for, spec_facts, trace_facts
    from moekit.dist.simulate import read_forwards, uniform_forwards
    from moekit.weights.gguf_spec import load_any_spec

    if (trace is None) == (uniform is None):
        raise MoekitError("give a TRACE.parquet or --uniform MODEL (one of the two)")
    if uniform is not None:
        if tokens < 1 or forwards < 1:
            raise MoekitError("--tokens and --forwards must be at least 1")
        spec = load_any_spec(uniform)
        facts = spec_facts(spec)
        return uniform_forwards(facts[2], facts[3], tokens, forwards), facts, spec.name
    fwd = read_forwards(trace)
    recorded = trace_facts(fwd.trace_model)
    if model is None and recorded is not None:
        return fwd, recorded, fwd.trace_model.name
    source = model or bundled_model_for(fwd.model.get("config_sha256"))
    if source is None:
        raise MoekitError(f"{trace}: the trace records no hidden size; name the model with --model CKPT (or a preset)")
    spec = load_any_spec(source)
    facts = spec_facts(spec)
    if facts[2] != fwd.experts and fwd.model:
        raise MoekitError(f"--model {source}: its MoE layers and experts do not match the trace's")
    return fwd, facts, spec.name


def _runs(fwd, counts, placement_file, redundant, groups, cost) -> list[dict]:
    from moekit.dist.placement import check_placement, linear_placement, read_placement
    from moekit.dist.plan import default_redundant, eplb_placement
    from moekit.dist.simulate import sim_report, simulate as replay

    experts = min(fwd.experts.values())
    if placement_file is not None:
        plan = read_placement(placement_file)
        check_placement(plan, fwd.experts, plan.ranks, fwd.model, placement_file)
        return [sim_report(fwd, plan, replay(fwd, plan, cost), cost)]
    results = []
    for r in counts:
        if r <= experts:
            lin = linear_placement(fwd.experts, r)
            results.append(sim_report(fwd, lin, replay(fwd, lin, cost), cost))
        extra = default_redundant(experts, r) if redundant is None else redundant
        g = groups if groups > 1 and (r // min(8, r)) <= groups else 0
        plan = eplb_placement(fwd, r, extra, groups=g)
        results.append(sim_report(fwd, plan, replay(fwd, plan, cost), cost))
    return results


def _print(doc: dict, wide: bool) -> None:
    from rich.console import Console

    from moekit.calc.units import nbytes
    from moekit.commands.fitted_table import Col, fitted_table, print_fitted

    timed = doc["results"][0]["moe_time_per_forward_s"] is not None
    cols = [Col("ranks"), Col("placement"), Col("redundant", essential=False), Col("balancedness"), Col("bytes/token"),
            Col("intra-node", essential=False), Col("inter-node", essential=False), Col("experts/rank")]
    if timed:
        cols += [Col("MoE µs/forward"), Col("of which all-to-all", essential=False)]
    rows = []
    for r in doc["results"]:
        cells = [str(r["ranks"]), r["placement"], str(r["redundant"]), f"{r['balancedness']:.3f}",
                 nbytes(r["bytes_per_token"]), nbytes(r["intra_node_bytes_per_token"]),
                 nbytes(r["inter_node_bytes_per_token"]), nbytes(r["expert_bytes_per_rank"])]
        if timed and r["fits_memory"] is False:
            cells += ["does not fit", "—"]
        elif timed:
            cells += [f"{r['moe_time_per_forward_s'] * 1e6:.1f}", f"{r['a2a_time_per_forward_s'] / r['moe_time_per_forward_s']:.0%}"]
        rows.append(cells)
    console = Console()
    title = (f"{doc['trace']} · {doc['model']} · {doc['tokens']} tokens per layer · {doc['dtype']}"
             + (f" · {doc['hardware']}" if doc["hardware"] else ""))
    table, dropped = fitted_table(title, cols, rows, console.width, wide)
    misfits = [r for r in doc["results"] if r["fits_memory"] is False]
    if misfits:
        table.caption = (f"does not fit: the routed experts on the fullest rank exceed one device's "
                         f"{nbytes(misfits[0]['device_memory_bytes'])} (routed experts only; more ranks, or a smaller --dtype)")
        table.caption_justify = "left"
    print_fitted(console, table, dropped, wide)
