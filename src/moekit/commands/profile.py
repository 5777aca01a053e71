"""`moekit profile`: which experts a workload uses, written as a pin file for `moekit run --pin`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from moekit.calc.dtypes import engine_dtype
from moekit.commands.options import ENGINE_DTYPE, NO_VERIFY
from moekit.errors import MoekitError

HELP = """Run PROMPTS (one per line) through CHECKPOINT and count each layer's expert use.

Writes a JSON profile: the model it was measured on, per-layer use counts, and per layer the --top
most used experts ("pins"). `moekit run ... --expert-memory 25% --pin profile.json` loads those at
start and never evicts them (at most half of each layer's slots are pinned). The prompts run on the
eager step (a profile is a few short generations: compiling the step would cost more than it saves).

Example:  moekit profile models/moekit-demo --prompts prompts.txt --out profile.json
"""


def profile(
    checkpoint: Path = typer.Argument(..., help="Checkpoint folder (config.json + *.safetensors + tokenizer.json)."),
    prompts: Path = typer.Option(..., "--prompts", help="Text file, one prompt per line."),
    out: Path = typer.Option(..., "--out", help="Where to write the profile JSON."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Tokens generated per prompt (greedy)."),
    top: Optional[int] = typer.Option(None, "--top", help="Experts pinned per layer (default: a quarter of them)."),
    dtype: str = typer.Option("fp32", "--dtype", help=ENGINE_DTYPE),
    expert_memory: Optional[str] = typer.Option(None, "--expert-memory", help="Profile a model larger than memory: as in `moekit run`."),
    no_verify: bool = typer.Option(False, "--no-verify", help=NO_VERIFY),
) -> None:
    from rich.progress import Progress

    from moekit.engine.loader import load_engine
    from moekit.analysis.profile import build_profile, read_prompts

    dtype = engine_dtype(dtype)
    texts = read_prompts(prompts)
    if max_new_tokens < 1:
        raise MoekitError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not out.parent.exists():
        raise MoekitError(f"--out {out}: folder {out.parent} does not exist")
    offload = None
    if expert_memory is not None:
        from moekit.offload.options import OffloadOptions

        offload = OffloadOptions(expert_memory=expert_memory)
    engine = load_engine(checkpoint, dtype=dtype, offload=offload, verify=not no_verify, compile=False)
    try:
        if engine.tokenizer is None:
            raise MoekitError(f"{checkpoint}: no tokenizer.json, so text prompts cannot be profiled")
        moe = [layer.ffn for layer in engine.spec.layers if layer.is_moe]
        if not moe:
            raise MoekitError(f"{checkpoint}: a dense model has no experts to profile")
        width = moe[0].num_experts
        top = width // 4 if top is None else top
        if not 1 <= top <= width:
            raise MoekitError(f"--top must be between 1 and {width} (experts per layer), got {top}")
        with Progress(transient=True) as bar:
            task = bar.add_task("profiling", total=len(texts))
            doc = build_profile(engine, texts, max_new_tokens, top, on_prompt=lambda n: bar.update(task, completed=n))
    finally:
        engine.close()
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, out)
    used = {l: sum(1 for c in row if c) for l, row in doc["counts"].items()}
    typer.echo(f"{len(texts)} prompts, {doc['workload']['tokens']} tokens; experts used per layer: "
               + ", ".join(f"L{l} {n}/{width}" for l, n in used.items()))
    typer.echo(f"wrote {out} ({top} pins per layer)")
