"""`moekit pack`: rewrite a checkpoint's routed experts contiguously for the tiered expert store.

torch is imported only inside `pack` (through moekit.offload.pack).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

HELP = """Pack every routed expert of a MoE checkpoint into one file, each expert's weights contiguous.

Writes CHECKPOINT/experts.packed.safetensors (our layout, the checkpoint's dtype) and CHECKPOINT/moekit-experts.json (where each expert is, with a crc32 per piece). `moekit run --expert-memory ...` then reads each expert with one positioned read. Optional: without it the store reads experts from the checkpoint's own safetensors files.

Examples:

  moekit pack path/to/checkpoint

  moekit pack path/to/checkpoint --out /fast-disk/experts.packed.safetensors
"""


def pack(
    checkpoint: Path = typer.Argument(..., help="Checkpoint folder (config.json + *.safetensors)."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Where to write the packed file (default: CHECKPOINT/experts.packed.safetensors)."
    ),
) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from moekit.calc.units import nbytes
    from moekit.offload.pack import pack_experts

    columns = (TextColumn("packing experts"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("pack", total=None)
        result = pack_experts(checkpoint, out, progress=lambda n, of: bar.update(task, completed=n, total=of))
    rate = result.nbytes / result.seconds if result.seconds > 0 else 0.0
    typer.echo(
        f"packed {result.experts} experts of {result.layers} MoE layers: {nbytes(result.nbytes)} "
        f"in {result.seconds:.2f} s ({nbytes(rate)}/s) → {result.path}"
    )
    typer.echo(f"wrote {result.manifest}")
