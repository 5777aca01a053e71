"""`moekit analyze`: routing statistics of a trace (load, router health, specialisation, reuse,
activation, the expert-cache hit-rate curve); tables, or --json."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import typer

from moekit.errors import MoekitError

HELP = """Routing statistics of a trace written by `moekit run --trace t.parquet` or `moekit report --trace`.

Per MoE layer and overall: expert load (max/mean, coefficient of variation, share of the hottest 10% of experts, experts never used), router health (entropy of the load and of each token's weights, the top-1 expert's share of the combine, a verdict), specialisation per domain (Jensen–Shannon divergence), reuse between consecutive tokens, co-activated pairs, how well a layer predicts the next layer's experts, the active share per token (by domain and position), and the expert-cache hit rate against slots per layer.

Examples:

  moekit analyze t.parquet

  moekit analyze t.parquet --json

  moekit analyze t.parquet --model path/to/checkpoint      # active parameters, not only experts
"""


def model_params(trace, model: Optional[Path]):
    """The model's parameter counts: --model, else the bundled model when the trace's config
    fingerprint is the bundled model's; None when neither (the share is then of routed experts)."""
    from moekit.engine.default_model import bundled_model_path
    from moekit.engine.meter import params_per_token
    from moekit.weights.gguf_spec import load_any_spec

    if model is None:
        bundled = bundled_model_path() / "config.json"
        sha = trace.model.config_sha256 if trace.model is not None else None
        if sha is None or not bundled.is_file() or hashlib.sha256(bundled.read_bytes()).hexdigest() != sha:
            return None
        model = bundled.parent
    spec = load_any_spec(str(model))
    params = params_per_token(spec)
    for layer, experts in trace.experts.items():
        if layer not in params.expert_each or spec.layers[layer].ffn.num_experts != experts:
            raise MoekitError(f"--model {model}: its MoE layers do not match the trace's (layer {layer}, "
                              f"{experts} experts): the trace comes from another model")
    return params


def analyze(
    trace: Path = typer.Argument(..., metavar="TRACE.parquet", help="Routing trace (Parquet)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of tables."),
    model: Optional[Path] = typer.Option(None, "--model", metavar="CKPT",
                                         help="Checkpoint (config.json) for parameter counts. Default: the bundled "
                                              "model when the trace is its."),
    num_experts: Optional[int] = typer.Option(None, "--num-experts", metavar="E",
                                              help="Experts per layer, for a trace that does not record them."),
    hit_rate: bool = typer.Option(True, "--hit-rate/--no-hit-rate", help="Replay the trace for the hit-rate curve."),
) -> None:
    from moekit.analysis.analyze import analyze as run_analysis
    from moekit.analysis.trace_data import read_routing_trace

    if num_experts is not None and num_experts < 1:
        raise MoekitError(f"--num-experts must be at least 1, got {num_experts}")
    data = read_routing_trace(trace, num_experts)
    stats = run_analysis(data, model_params(data, model), hit_rate=hit_rate)
    stats["trace"] = str(trace)
    if as_json:
        typer.echo(json.dumps(stats, indent=1))
        return
    from rich.console import Console

    from moekit.commands.analysis_tables import print_tables

    print_tables(Console(width=max(100, Console().width)), stats)
