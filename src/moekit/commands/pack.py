"""`moekit pack`: rewrite a checkpoint's routed experts contiguously for the tiered expert store.

torch is imported only inside `pack` (through moekit.offload.pack).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

HELP = """Pack every routed expert of a MoE checkpoint into one file, each expert's weights contiguous, in a new folder: the packed checkpoint.

The checkpoint is left exactly as it was. OUT (default: a folder per checkpoint under ~/.cache/moekit/packed) receives experts.packed.safetensors (our layout, the checkpoint's dtype), moekit-experts.json (where each expert is, with a crc32 per piece) and the checkpoint's other files, hard-linked where the disk allows, else copied. `moekit run OUT --expert-memory ...` then reads each expert with one positioned read. Optional: without it the store reads experts from the checkpoint's own safetensors files.

Examples:

  moekit pack path/to/checkpoint

  moekit pack path/to/checkpoint --out /fast-disk/checkpoint-packed
"""


def pack(
    checkpoint: Path = typer.Argument(..., help="Checkpoint folder (config.json + *.safetensors); never changed."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Folder for the packed checkpoint: new, empty, or an earlier pack's "
        "(default: ~/.cache/moekit/packed/NAME-HASH)."
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
    how = [f"{len(result.linked)} hard-linked" if result.linked else "", f"{len(result.copied)} copied" if result.copied else ""]
    typer.echo(f"packed checkpoint: {result.folder} (the checkpoint's other files: "
               f"{', '.join(h for h in how if h) or 'none'}; {checkpoint} is unchanged)")
    typer.echo(f"run it: moekit run {result.folder} \"PROMPT\" --expert-memory 25%")
