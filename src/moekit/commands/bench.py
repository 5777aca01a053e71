"""`moekit bench`: speed measured as ratios in one run. torch (and transformers) load inside the command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from moekit.errors import MoekitError

app = typer.Typer(help="Measure moekit's speed against a named baseline, in one run.", no_args_is_help=True)

DECODE_HELP = """Decode tokens/s of moekit vs transformers' generate on one checkpoint, at batch 1 and 8.

Both run greedy on the same random prompts and dtype, in this process; the table gives the ratio, the bandwidth roofline of this machine (measured memory bandwidth / bytes one decode step reads) and the share of it moekit reaches.

  moekit bench decode path/to/checkpoint --vs transformers --batch 1,8 --tokens 32
"""


def _batches(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise MoekitError(f"--batch: expected comma-separated sizes like 1,8, got {text!r}") from None
    if not sizes:
        raise MoekitError("--batch: give at least one batch size")
    return sizes


def local_bandwidth() -> tuple[float, str]:
    """(bytes/s, how it was known): the calculator's `local` entry, measured now by its probe."""
    from moekit.calc.hardware import get_hardware

    hw = get_hardware("local")
    return hw.bandwidth, "measured by the local probe"


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _fmt(value: Optional[float], spec: str) -> str:
    return "—" if value is None else format(value, spec)


@app.command("decode", help=DECODE_HELP)
def decode(
    checkpoint: Optional[Path] = typer.Argument(
        None, help="Checkpoint folder (config.json + *.safetensors). Default: the bundled demo model."
    ),
    vs: Optional[str] = typer.Option(None, "--vs", help="Baseline to compare against: transformers."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16 (both sides)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (both sides)."),
    batch: str = typer.Option("1,8", "--batch", help="Comma-separated batch sizes."),
    tokens: int = typer.Option(32, "--tokens", help="New tokens per row."),
    prompt_len: int = typer.Option(16, "--prompt-len", help="Prompt tokens per row."),
    repeats: int = typer.Option(3, "--repeats", help="Timed runs per side; the median is reported."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed runs first."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for both sides (default: torch's)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    if vs not in (None, "transformers"):
        raise MoekitError(f"--vs {vs}: the only baseline is transformers")
    from moekit.engine.bench_decode import BenchSettings, bench_decode
    from moekit.engine.default_model import default_checkpoint
    from moekit.engine.loader import load_engine

    checkpoint = checkpoint if checkpoint is not None else default_checkpoint()

    settings = BenchSettings(
        batches=_batches(batch), tokens=tokens, prompt_len=prompt_len, repeats=repeats, warmup=warmup
    )
    if threads is not None:
        if threads < 1:
            raise MoekitError(f"--threads must be at least 1, got {threads}")
        import torch

        torch.set_num_threads(threads)
    engine = load_engine(checkpoint, dtype=dtype, device=device)
    bandwidth, source = local_bandwidth() if engine.device == "cpu" else (None, "roofline: CPU only for now")
    results = bench_decode(engine, settings, vs_transformers=vs == "transformers", bandwidth_bytes_s=bandwidth)

    if json_out:
        typer.echo(
            json.dumps(
                {
                    "checkpoint": str(checkpoint),
                    "model_type": engine.spec.model_type,
                    "dtype": dtype,
                    "device": engine.device,
                    "tokens": tokens,
                    "prompt_len": prompt_len,
                    "repeats": repeats,
                    "threads": _threads(),
                    "bandwidth_bytes_s": bandwidth,
                    "bandwidth_source": source,
                    "results": [r.as_dict() for r in results],
                }
            )
        )
        return

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode tokens/s · {engine.spec.model_type} · {dtype} on {engine.device}")
    table.add_column("batch", justify="right")
    table.add_column("moekit", justify="right")
    table.add_column("transformers", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("MB / step", justify="right")
    table.add_column("roofline", justify="right")
    table.add_column("share of roofline", justify="right")
    table.add_column("same tokens", justify="center")
    for r in results:
        table.add_row(
            str(r.batch),
            f"{r.moekit_tok_s:.1f}",
            _fmt(r.transformers_tok_s, ".1f"),
            _fmt(r.ratio, ".2f") + ("×" if r.ratio else ""),
            f"{r.bytes_per_step / 1e6:.1f}",
            _fmt(r.roofline_tok_s, ".1f"),
            _fmt(r.roofline_share, ".0%"),
            "—" if r.same_tokens is None else ("yes" if r.same_tokens else "NO"),
        )
    console = Console()
    console.print(table)
    bw = f"{bandwidth / 1e9:.1f} GB/s ({source})" if bandwidth else source
    console.print(
        f"memory bandwidth: {bw}; median of {repeats} runs after {warmup} warm-up; "
        f"{tokens} new tokens per row after {prompt_len} prompt tokens; {_threads()} threads"
    )
