"""`moekit run`: generate from a checkpoint folder with the native engine, metering every token.

torch is imported only inside `run` (through moekit.engine), so registering this command costs
nothing for `moekit calc`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from moekit.errors import MoekitError

HELP = """Generate tokens from a Hugging Face MoE checkpoint with the native engine.

CHECKPOINT is a folder with config.json and *.safetensors (tokenizer.json optional: without it, give --prompt-ids). Without one (or when the first argument is not an existing folder) moekit runs its bundled demo model, models/moekit-demo.

Examples:

  moekit run "def parse_args(argv):"                      # the bundled model

  moekit run path/to/checkpoint "def fibonacci(n):" --max-new-tokens 64

  moekit run path/to/checkpoint --prompt-ids 1,17,42 --max-new-tokens 24 --temperature 0 --json

  moekit run path/to/checkpoint "Hello" --show-activation

  moekit run path/to/checkpoint "Hello" --expert-memory 25%        # routed experts paged from disk

  moekit run path/to/checkpoint "Hello" --expert-memory 1GiB --cache lfu --pin profile.json --prefetch
"""


def parse_ids(text: Optional[str], what: str) -> Optional[list[int]]:
    """'1,17, 42' -> [1, 17, 42]; one clear line on anything else."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise MoekitError(f"{what}: no token ids given")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise MoekitError(f"{what}: expected comma-separated integer token ids, got {text!r}") from None


def _expert_summary(act, width: int = 60) -> str:
    text = " ".join(f"L{layer}:{','.join(map(str, ids))}" for layer, ids in act.experts.items())
    return text if len(text) <= width else text[: width - 1] + "…"


def _token_text(engine, token_id: int) -> str:
    if engine.tokenizer is None:
        return str(token_id)
    text = engine.tokenizer.decode([token_id])
    if not text or "\ufffd" in text:  # part of a multi-byte character: show the raw piece
        text = engine.tokenizer.id_to_token(token_id) or str(token_id)
    return repr(text)[1:-1]


def _activation_table(engine, acts):
    from rich.table import Table

    moe = bool(engine.spec.moe_layers)
    table = Table(title="activation per generated token", show_lines=False)
    table.add_column("#", justify="right")
    table.add_column("token")
    if moe:
        table.add_column("experts (layer:ids)")
    table.add_column("params touched", justify="right")
    table.add_column("active share", justify="right")
    if moe:
        table.add_column("distinct experts", justify="right")
    for a in acts:
        cells = [str(a.index), _token_text(engine, a.token_id)]
        if moe:
            cells.append(_expert_summary(a))
        cells += [f"{a.params_touched:,}", f"{a.share:.2%}"]
        if moe:
            cells.append(str(a.distinct_experts_total))
        table.add_row(*cells)
    return table


def run(
    first: Optional[str] = typer.Argument(
        None,
        metavar="[CHECKPOINT]",
        help="Checkpoint folder: config.json + *.safetensors (+ tokenizer.json). Default: the bundled model.",
    ),
    second: Optional[str] = typer.Argument(
        None, metavar="[PROMPT]", help="Text prompt (needs tokenizer.json in the folder)."
    ),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Comma-separated token ids instead of text."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate at most."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the k most likely tokens."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (reproducible runs)."),
    stop: Optional[str] = typer.Option(None, "--stop", help="Comma-separated stop token ids (default: the model's eos; '' never stops early)."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write the routing trace to this Parquet file."),
    show_activation: bool = typer.Option(
        False, "--show-activation", help="Per token: experts chosen, params touched, share of all params."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    expert_memory: Optional[str] = typer.Option(
        None, "--expert-memory", help="Memory for routed experts: a share of all expert bytes (25%) or bytes (2GiB); "
        "the rest stays on disk. Default: all resident."),
    cache: str = typer.Option("lru", "--cache", help="Expert cache policy: lru, lfu, lfu-aging (or none: read on every use)."),
    pin: Optional[Path] = typer.Option(None, "--pin", help="Profile from `moekit profile`: its experts stay resident."),
    prefetch: bool = typer.Option(False, "--prefetch/--no-prefetch", help="Guess each layer's experts ahead of it and read them "
                                  "on worker threads (off by default: see docs/BENCHMARKS.md)."),
    prefetch_extra: int = typer.Option(4, "--prefetch-extra", help="Experts guessed per token beyond its K when prefetching."),
) -> None:
    from moekit.engine.default_model import split_checkpoint_and_prompt
    from moekit.engine.loader import load_engine
    from moekit.engine.sampling import SamplingParams, check_sampling

    ids = parse_ids(prompt_ids, "--prompt-ids")
    checkpoint, prompt = split_checkpoint_and_prompt(first, second, ids_given=ids is not None)
    if (prompt is None) == (ids is None):
        raise MoekitError("give either a text PROMPT or --prompt-ids, not both and not neither")
    if max_new_tokens <= 0:
        raise MoekitError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    check_sampling(sampling)
    stop_ids = () if stop is not None and not stop.strip() else parse_ids(stop, "--stop")
    if trace is not None and not trace.parent.exists():
        raise MoekitError(f"--trace {trace}: folder {trace.parent} does not exist")

    offload = None
    if expert_memory is not None:
        from moekit.offload.options import OffloadOptions

        offload = OffloadOptions(expert_memory=expert_memory, policy=cache, pin=pin, prefetch=prefetch,
                                 prefetch_extra=prefetch_extra)
    elif pin is not None or prefetch or cache != "lru":
        raise MoekitError("--cache, --pin and --prefetch need --expert-memory")
    engine = load_engine(checkpoint, dtype=dtype, device=device, offload=offload, progress=_manifest_progress())
    for note in engine.notes:
        typer.echo(f"note: {note}", err=True)
    try:
        _generate_and_report(engine, ids, prompt, max_new_tokens, sampling, stop_ids, trace, show_activation, json_out)
    finally:
        engine.close()


def _manifest_progress():
    """A progress bar for the one-off checksum pass over every expert (first offloaded run)."""
    state = {}

    def progress(done: int, total: int) -> None:
        from rich.progress import Progress

        if "bar" not in state:
            state["bar"] = Progress(transient=True, console=None)
            state["bar"].start()
            state["task"] = state["bar"].add_task("checksumming experts (once)", total=total)
        state["bar"].update(state["task"], completed=done)
        if done >= total:
            state["bar"].stop()

    return progress


def _generate_and_report(engine, ids, prompt, max_new_tokens, sampling, stop_ids, trace, show_activation, json_out):
    from moekit.engine.detokenize import TextStream

    prompt_tokens = engine.encode(prompt) if ids is None else ids
    out = sys.stdout

    on_token = None
    stream = None
    if not json_out:
        if engine.tokenizer is not None:
            stream = TextStream(engine.tokenizer)

            def on_token(step, row_ids):
                if row_ids[0] is not None:
                    out.write(stream.push(row_ids[0]))
                    out.flush()

        else:

            def on_token(step, row_ids):
                if row_ids[0] is not None:
                    out.write(("" if step == 0 else " ") + str(row_ids[0]))
                    out.flush()

    snapshot = {}
    if engine.store is not None:
        shown = on_token

        def on_token(step, row_ids):
            if step == 0:
                snapshot.update(engine.store.stats())
            if shown is not None:
                shown(step, row_ids)

    gen = engine.generate(prompt_tokens, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids, on_token=on_token)
    acts = engine.meter(gen)
    offload = None
    if engine.store is not None:
        from moekit.offload.report import offload_report

        offload = offload_report(snapshot, engine.store.stats(), gen.timing.decode_tokens, gen.timing.decode_s)
    if trace is not None:
        from moekit.engine.trace import write_trace

        rows = write_trace(gen, trace)
    generated = gen.token_ids[0]

    if json_out:
        payload = {
            "token_ids": generated,
            "text": engine.decode(generated) if engine.tokenizer is not None else None,
            "stopped": gen.stopped[0],
            "activation": [a.as_dict() for a in acts],
            "timing": gen.timing.as_dict(),
        }
        if offload is not None:
            payload["offload"] = offload
        if engine.tokenizer is None:
            del payload["text"]
        out.write(json.dumps(payload) + "\n")
        return

    if stream is not None:
        out.write(stream.flush())
    out.write("\n")
    out.flush()
    t = gen.timing
    typer.echo(
        f"[{len(generated)} tokens · prefill {t.prefill_s * 1e3:.1f} ms · decode {t.decode_tok_s:.1f} tok/s"
        f" · {engine.dtype} on {engine.device}]",
        err=True,
    )
    if trace is not None:
        typer.echo(f"routing trace: {rows} rows -> {trace}", err=True)
    if show_activation:
        from rich.console import Console

        console = Console(file=out, width=max(100, Console().width))
        console.print(_activation_table(engine, acts))
        if offload is not None:
            console.print(_offload_table(offload))


def _offload_table(report: dict):
    from rich.table import Table

    from moekit.calc.units import nbytes as format_bytes

    d = report["decode"]
    table = Table(title=f"expert store: {report['policy']}, {report['slots_per_layer']} slots per layer, "
                        f"prefetch {'on' if report['prefetch'] else 'off'}")
    table.add_column("figure")
    table.add_column("value", justify="right")

    def pct(x):
        return "—" if x is None else f"{x:.1%}"

    rows = [
        ("decode hit rate", pct(d["hit_rate"])),
        *((f"  layer {l}", pct(h)) for l, h in d["hit_rate_per_layer"].items()),
        ("disk bytes per decoded token", "—" if d["disk_bytes_per_token"] is None else format_bytes(d["disk_bytes_per_token"])),
        ("stall per decoded token", "—" if d["stall_s_per_token"] is None else f"{d['stall_s_per_token'] * 1e3:.2f} ms"),
        ("stall share of decode time", pct(d["stall_share"])),
        ("prefetch precision / recall", f"{pct(report['prefetch_precision'])} / {pct(report['prefetch_recall'])}"),
        ("prefill loads", f"{report['prefill']['loads']} ({format_bytes(report['prefill']['disk_bytes'])})"),
        ("peak resident expert bytes", format_bytes(report["peak_resident_expert_bytes"])),
        ("process peak RSS", format_bytes(report["peak_rss_bytes"])),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
