"""`moekit eval-routing`: each routing policy's quality cost and parameter saving on held-out text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from moekit.commands.fitted_table import Col, fitted_table, print_fitted
from moekit.commands.options import NO_VERIFY
from moekit.errors import MoekitError

HELP = """Measure routing policies against the family's exact routing on a corpus's held-out split.

Per policy, on every domain and pooled: bits per byte (and the change against exact routing), routed experts per token, the mean active share, the share of positions whose greedy next token equals exact routing's, and the share of a greedy continuation generated before it first differs from exact routing's. The --batch windows run side by side, so each position is one batched step: per step, the distinct experts read, the assignments beyond capacity 1.0, and the hit rate of a paged store holding a quarter of the experts (LRU). Policies: topk:k (k up to E), adaptive:τ, topp:p, ema:α, reuse, temp:T, gumbel:σ[:seed], minconf:c, split:k:w, cache:N[:q] (its hit rate is shown), loadaware:Δ[:f[:decay]], capacity:f:drop|reroute, and P+reset:N (docs/ROUTING.md). Every policy runs on the eager step, fp32 (the exact arithmetic the comparison needs).

Examples:

  moekit eval-routing                                   # the bundled model on its shipped held-out sample

  moekit eval-routing --corpus data/corpus --policies top1,adaptive:0.6,adaptive:0.85,topp:0.9

  moekit eval-routing path/to/checkpoint --corpus data/corpus --json --plot pareto.png
"""

POLICIES = "topk:1,adaptive:0.6,adaptive:0.85,topp:0.9,ema:0.95,reuse"


def check_counts(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise MoekitError(f"--{name.replace('_', '-')} must not be negative, got {value}")


def load_for_routing(checkpoint: Optional[Path], device: str, threads: Optional[int], verify: bool = True):
    """The engine in fp32 (policies are compared on exact arithmetic), on `threads` CPU threads; None
    keeps torch's default (every core), as `moekit run` does."""
    import torch

    from moekit.engine.default_model import default_checkpoint
    from moekit.engine.loader import load_engine

    if threads is not None:
        if threads < 1:
            raise MoekitError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    return load_engine(checkpoint if checkpoint is not None else default_checkpoint(), dtype="float32", device=device,
                       verify=verify, compile=False)


def eval_routing(
    checkpoint: Optional[Path] = typer.Argument(None, metavar="CHECKPOINT", help="Checkpoint folder. Default: the bundled model."),
    corpus: Optional[Path] = typer.Option(None, "--corpus", help="A corpus built by `moekit corpus build`. Default: "
                                          "the held-out sample shipped with moekit."),
    policies: str = typer.Option(POLICIES, "--policies", help="Comma-separated policies (exact routing is always measured)."),
    max_tokens: int = typer.Option(4096, "--max-tokens", help="Held-out tokens scored per domain (at most)."),
    window: int = typer.Option(256, "--window", help="Tokens per scored window."),
    agree_prompts: int = typer.Option(4, "--agree-prompts", help="Documents per domain continued greedily under each policy."),
    agree_tokens: int = typer.Option(32, "--agree-tokens", help="Tokens generated per continuation."),
    batch: int = typer.Option(8, "--batch", help="Windows scored side by side: the rows of one batched step "
                              "(load control's capacity is per step)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    no_verify: bool = typer.Option(False, "--no-verify", help=NO_VERIFY),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for torch. Default: torch's own (every "
                                          "core), as `moekit run`."),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="PNG", help="Write the Pareto plot (active share vs bits per byte)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of tables."),
    wide: bool = typer.Option(False, "--wide", help="Every column, whatever the terminal's width (default: what fits)."),
) -> None:
    from moekit.analysis.policy_eval import evaluate_policies, model_experts, model_k, parse_policies
    from moekit.analysis.sample import SAMPLE

    if window < 2 or max_tokens < 2:
        raise MoekitError("--window and --max-tokens must be at least 2")
    check_counts(agree_prompts=agree_prompts, agree_tokens=agree_tokens)
    if batch < 1:
        raise MoekitError(f"--batch must be at least 1, got {batch}")
    if plot is not None and not plot.parent.exists():
        raise MoekitError(f"--plot {plot}: folder {plot.parent} does not exist")
    engine = load_for_routing(checkpoint, device, threads, verify=not no_verify)
    chosen = parse_policies(policies, model_k(engine.spec), model_experts(engine.spec))
    from rich.console import Console

    err = Console(stderr=True)
    with err.status("scoring…") as status:
        result = evaluate_policies(engine, corpus if corpus is not None else SAMPLE, chosen, max_tokens, window,
                                   agree_prompts, agree_tokens, progress=lambda text: status.update(text), batch=batch)
    result["model"] = engine.spec.name
    if plot is not None:
        import base64

        from moekit.analysis.plots import pareto_plot

        plot.write_bytes(base64.b64decode(pareto_plot(result)))
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    print_routing(Console(), result, wide)


ROUTING_COLUMNS = [Col("policy"), Col("bits/byte"), Col("Δ vs exact"), Col("experts/token/layer", essential=False),
                   Col("active share"), Col("next-token agree", essential=False), Col("generated agree", essential=False),
                   Col("experts/step", essential=False), Col("step overflow", essential=False),
                   Col("paged hits (25%)", essential=False), Col("cache hits", essential=False)]


def print_routing(console, result: dict, wide: bool = False) -> None:
    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    for scope, rows in [("all domains", result["all"])] + [(f"domain {d}", r) for d, r in result["domains"].items()]:
        cells = [[name, f"{r['bits_per_byte']:.4f}", f"{r['delta_bits_per_byte']:+.4f}", f"{r['experts_per_token']:.3f}",
                  f"{r['active_share']:.3%}", pct(r["next_token_agreement"]), pct(r["generated_agreement"]),
                  f"{r['experts_per_step']:.2f}", pct(r["step_overflow"]), pct(r["paged_hit_rate"]), pct(r["cache_hit_rate"])]
                 for name, r in rows.items()]
        title = f"{result['model']} · routing policies · {scope} ({next(iter(rows.values()))['tokens']:,} tokens)"
        table, dropped = fitted_table(title, ROUTING_COLUMNS, cells, console.width, wide)
        print_fitted(console, table, dropped, wide)
