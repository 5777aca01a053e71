"""`moekit eval`: held-out loss and perplexity per domain, a unigram baseline, expert usage per domain."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moekit.commands.options import NO_VERIFY

HELP = """Evaluate a run folder or checkpoint on a corpus's held-out split.

Per domain: loss (nats/token) and perplexity, the perplexity of a unigram model fit on the train
split with the same tokenizer, and which experts the domain's tokens choose (per layer). Between
domains: the Jensen–Shannon divergence of their expert usage (bits, mean over layers). Windows are
scored by the eager forward (no decode step, so nothing is compiled).

Example:  moekit eval runs/demo --corpus data/corpus
"""


def evaluate(
    target: Path = typer.Argument(..., help="A run folder (uses its model/) or a checkpoint folder."),
    corpus: Path = typer.Option(Path("data/corpus"), "--corpus", help="A corpus built by `moekit corpus build`."),
    max_tokens: int = typer.Option(50_000, help="Held-out tokens scored per domain (at most)."),
    window: int = typer.Option(256, help="Tokens per scored window."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    no_verify: bool = typer.Option(False, "--no-verify", help=NO_VERIFY),
    as_json: bool = typer.Option(False, "--json", help="Print the full result as JSON."),
) -> None:
    from rich.console import Console
    from rich.table import Table

    from moekit.errors import MoekitError
    from moekit.train.evaluate import evaluate as run_eval
    from moekit.train.evaluate import resolve_checkpoint

    if window < 2 or max_tokens < 2:
        raise MoekitError("--window and --max-tokens must be at least 2")
    from moekit.corpus.reader import empty_domains_note

    console = Console(stderr=True)
    checkpoint = resolve_checkpoint(target)  # what to evaluate is checked first: it is the argument
    note = empty_domains_note(corpus, "heldout")
    if note:
        typer.echo(note, err=True)
    result = run_eval(checkpoint, corpus, window=window, max_tokens=max_tokens, device=device,
                      verify=not no_verify, progress=lambda d: console.print(f"scoring {d}…") if not as_json else None)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
        return
    table = Table(title=f"held-out evaluation of {target}")
    for col in ("domain", "tokens", "loss", "perplexity", "unigram ppl", "top experts (layer 0)"):
        table.add_column(col, justify="left" if col in ("domain", "top experts (layer 0)") else "right")
    for d, r in result.domains.items():
        top = sorted(range(len(r.usage[0])), key=lambda e: -r.usage[0][e])[:4]
        table.add_row(d, str(r.tokens), f"{r.loss:.3f}", f"{r.perplexity:.1f}", f"{r.unigram_perplexity:.1f}",
                      " ".join(f"{e}:{r.usage[0][e]:.0%}" for e in top))
    out = Console()
    out.print(table)
    div = Table(title="expert-usage divergence between domains (Jensen–Shannon, bits, mean over layers)")
    names = list(result.domains)
    div.add_column("")
    for n in names:
        div.add_column(n, justify="right")
    for a in names:
        div.add_row(a, *(f"{result.divergence[a][b]:.3f}" for b in names))
    out.print(div)
