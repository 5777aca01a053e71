"""`moekit report`: run labelled prompts, trace and analyse them, score the routing policies, and
write one self-contained HTML file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from moekit.commands.options import NO_VERIFY
from moekit.errors import MoekitError

HELP = """Write one self-contained HTML report (plots embedded, opens offline) of a model's routing.

Runs each prompt (greedy, batch 1), keeps the routing trace, analyses it as `moekit analyze` does and scores the routing policies as `moekit eval-routing` does. Default prompts: the first held-out documents of every domain of the bundled model's corpus (a sample ships with moekit), so `moekit report` works on a fresh clone.

Examples:

  moekit report                                               # the bundled model -> report.html

  moekit report path/to/checkpoint --prompts prompts.jsonl --out report.html   # {"text": ..., "domain": ...} per line

  moekit report --corpus data/corpus --per-domain 16 --eval-tokens 8192 --trace report.parquet
"""


class Stages:
    """Progress of `moekit report`: a line on stderr as each stage starts (with the seconds so far),
    so a log or a pipe sees it too, and the spinner's text updated within a stage."""

    def __init__(self, spinner, echo):
        import time

        self.spinner, self.echo, self.clock, self.start, self.stage = spinner, echo, time.monotonic, time.monotonic(), None

    def update(self, text: str) -> None:
        stage = text.split("…")[0].split(":")[0]
        if stage != self.stage:
            self.stage = stage
            self.echo(f"report [{self.clock() - self.start:5.1f} s] {text}")
        self.spinner.update(text)


def report(
    checkpoint: Optional[Path] = typer.Argument(None, metavar="CHECKPOINT", help="Checkpoint folder. Default: the bundled model."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", metavar="JSONL",
                                           help='Prompts, one {"text": ..., "domain": ...} per line (domain optional).'),
    corpus: Optional[Path] = typer.Option(None, "--corpus", help="Take prompts and the policies' held-out text from this "
                                          "corpus. Default: the shipped held-out sample."),
    out: Path = typer.Option(Path("report.html"), "--out", help="The HTML file to write."),
    per_domain: int = typer.Option(8, "--per-domain", help="Held-out documents per domain used as prompts."),
    prompt_tokens: int = typer.Option(256, "--prompt-tokens", help="Each prompt cut to its first tokens."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Tokens generated per prompt."),
    routing: Optional[str] = typer.Option(None, "--routing", metavar="POLICY", help="Run the prompts under a routing policy."),
    policies: str = typer.Option("topk:1,adaptive:0.6,adaptive:0.85,topp:0.9,ema:0.95,reuse", "--policies",
                                 help="Policies scored for the Pareto plot ('' skips it)."),
    eval_tokens: int = typer.Option(1024, "--eval-tokens", help="Held-out tokens per domain for the policies."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Also keep the combined routing trace (*.parquet)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    no_verify: bool = typer.Option(False, "--no-verify", help=NO_VERIFY),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for torch. Default: torch's own (every "
                                          "core), as `moekit run`."),
) -> None:
    from moekit.analysis.analyze import analyze
    from moekit.analysis.policy_eval import evaluate_policies, model_k, parse_policies
    from moekit.analysis.prompts import corpus_prompts, read_prompts
    from moekit.analysis.report import figures, render, summary_lines
    from moekit.analysis.sample import SAMPLE
    from moekit.analysis.trace_data import from_table
    from moekit.commands.eval_routing import load_for_routing
    from moekit.model.routing import parse_policy

    if not out.parent.exists():
        raise MoekitError(f"--out {out}: folder {out.parent} does not exist")
    if trace is not None and trace.suffix.lower() != ".parquet":
        raise MoekitError(f"--trace {trace}: the trace is written as Parquet; name the file *.parquet")
    if min(per_domain, prompt_tokens, max_new_tokens) < 1 or eval_tokens < 2:
        raise MoekitError("--per-domain, --prompt-tokens and --max-new-tokens must be at least 1, --eval-tokens at least 2")
    if corpus is not None:
        from moekit.corpus.reader import empty_domains_note

        note = empty_domains_note(corpus, "heldout")
        if note:
            typer.echo(note, err=True)
    chosen = read_prompts(prompts) if prompts is not None else corpus_prompts(corpus, per_domain)
    engine = load_for_routing(checkpoint, device, threads, verify=not no_verify)
    k = model_k(engine.spec)
    policy = parse_policy(routing, k) if routing is not None else None
    scored = parse_policies(policies, k) if policies.strip() else None
    from rich.console import Console

    err = Console(stderr=True)
    with err.status("running prompts…") as spinner:
        status = Stages(spinner, lambda line: typer.echo(line, err=True))
        status.update(f"running prompts… 0/{len(chosen)}")
        from moekit.analysis.run_trace import trace_prompts

        table = trace_prompts(engine, chosen, prompt_tokens, max_new_tokens, policy,
                              progress=lambda d, n: status.update(f"running prompts… {d}/{n}"))
        if trace is not None:
            import pyarrow.parquet as pq

            pq.write_table(table, trace)
        status.update("analysing the trace…")
        data = from_table(table, "report trace")
        from moekit.engine.meter import params_per_token

        params = params_per_token(engine.spec)
        stats = analyze(data, params)
        routing_result = None
        if scored is not None:
            routing_result = evaluate_policies(engine, corpus if corpus is not None else SAMPLE, scored, eval_tokens,
                                               256, 2, 16, progress=lambda text: status.update(f"policies: {text}"))
        status.update("drawing…")
        name = policy if policy is not None else "exact"
        figs = figures(data, stats, routing_result, params, table)
        facts = (f"{engine.spec.name} · {engine.spec.model_type} · {len(engine.spec.moe_layers)} MoE layers × "
                 f"{max(data.experts.values())} experts, K = {k} · {len(chosen)} prompts "
                 f"({', '.join(data.domains)}) · {max_new_tokens} generated tokens each, greedy · routing {name}")
        html = render(engine.spec.name, facts, summary_lines(stats, routing_result, params, str(name)), figs,
                      "moekit " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["report"] else "moekit report")
    out.write_text(html, encoding="utf-8")
    typer.echo(f"wrote {out} ({len(html) / 1e6:.1f} MB, {len(figs)} figures, {stats['activation']['share']['tokens']:,} "
               f"tokens traced)", err=True)
