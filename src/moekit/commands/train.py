"""`moekit train`: train a fine-grained MoE from a TOML config on a built corpus, resumably."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

HELP = """Train a MoE language model with moekit's own modules; save it in the Hub's format.

The run folder OUT holds checkpoints (every checkpoint_every steps, written atomically), metrics.jsonl
(loss, per-expert load, imbalance, router entropy) and OUT/model, a checkpoint that transformers and
`moekit run` load. An existing run is refused unless --resume (continue it) or --force (replace it).

Example:  moekit train --config configs/demo.toml --out runs/demo
"""


def train(
    # \[ : rich reads a bare [model] in help as markup and prints nothing.
    config: Path = typer.Option(..., "--config", help=r"TOML file with \[model] and \[train] tables."),
    out: Path = typer.Option(..., "--out", help="Run folder."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in OUT from its last checkpoint."),
    force: bool = typer.Option(False, "--force", help="Replace whatever run OUT holds."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda (default: the config's)."),
    threads: Optional[int] = typer.Option(None, help="CPU threads (default: the config's; 0 = torch's)."),
) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from moekit.train.config import load_config
    from moekit.train.session import train as run_train

    total = load_config(config).train.steps
    columns = (TextColumn("train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns) as bar:
        task = bar.add_task("train", total=total, info="")

        def on_step(step: int, line: dict | None) -> None:
            info = None
            if line is not None:
                info = (f"loss {line['loss']:.3f}  imbalance {line['imbalance']:.2f}  "
                        f"{line['tokens_per_s']:.0f} tok/s")
            bar.update(task, completed=step, **({"info": info} if info else {}))

        result = run_train(config, out, resume=resume, force=force, device=device, threads=threads,
                           say=bar.console.print, on_step=on_step)
    typer.echo(f"trained {result['steps']} steps; model saved to {result['model']}")
