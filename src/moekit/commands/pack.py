"""`moekit pack`: rewrite a checkpoint's routed experts contiguously for the tiered expert store.

torch is imported only inside `pack` (through moekit.offload.pack).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

HELP = """Pack every routed expert of a MoE checkpoint into one file, each expert's weights contiguous, in a new folder: the packed checkpoint.

The checkpoint is left exactly as it was. OUT (default: a folder per checkpoint under ~/.cache/moekit/packed) receives experts.packed.safetensors (our layout, the checkpoint's dtype), moekit-experts.json (where each expert is, with a crc32 per piece) and the checkpoint's other files, hard-linked where the disk allows, else copied. `moekit run OUT --expert-memory ...` then reads each expert with one positioned read. Optional: without it the store reads experts from the checkpoint's own safetensors files.

--precision int8 (or int4, bf16, fp32) writes every expert at that precision: int8 is q8_0 (a float16 scale per 32 weights, 34 bytes per 32), int4 is q4_0 (18 bytes per 32), both in the layout the store multiplies from. --precision-by-profile writes each layer's most used experts (a `moekit profile` of this model) at --hot and the rest at --cold; --hot-share is the share of each layer's experts kept hot. A packed checkpoint with int8/int4 experts always runs them from the pack (through the expert store, all resident unless --expert-memory says less).

Examples:

  moekit pack path/to/checkpoint

  moekit pack path/to/checkpoint --out /fast-disk/checkpoint-packed

  moekit pack path/to/checkpoint --precision int8 --out ckpt-int8

  moekit pack path/to/checkpoint --precision-by-profile profile.json --hot bf16 --cold int4 --hot-share 25% --out ckpt-mixed
"""


def pack(
    checkpoint: Path = typer.Argument(..., help="Checkpoint folder (config.json + *.safetensors); never changed."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Folder for the packed checkpoint: new, empty, or an earlier pack's "
        "(default: ~/.cache/moekit/packed/NAME-HASH)."
    ),
    precision: Optional[str] = typer.Option(
        None, "--precision", help="Every expert at bf16, fp32, int8 (q8_0) or int4 (q4_0). Default: the checkpoint's dtype."
    ),
    profile: Optional[Path] = typer.Option(
        None, "--precision-by-profile", help="A `moekit profile` JSON of this model: hot experts at --hot, the rest at --cold."
    ),
    hot: Optional[str] = typer.Option(None, "--hot", help="Precision of each layer's most used experts (with "
                                      "--precision-by-profile; default bf16)."),
    cold: Optional[str] = typer.Option(None, "--cold", help="Precision of the others (with --precision-by-profile; default int8)."),
    hot_share: Optional[str] = typer.Option(None, "--hot-share", help="Share of each layer's experts kept hot, e.g. 25% "
                                            "or 0.25 (with --precision-by-profile; default 25%)."),
) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from moekit.calc.units import nbytes
    from moekit.offload.pack import pack_experts

    precisions = _precisions(checkpoint, precision, profile, hot, cold, hot_share)
    columns = (TextColumn("packing experts"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("pack", total=None)
        result = pack_experts(checkpoint, out, progress=lambda n, of: bar.update(task, completed=n, total=of),
                              precisions=precisions)
    rate = result.nbytes / result.seconds if result.seconds > 0 else 0.0
    typer.echo(
        f"packed {result.experts} experts of {result.layers} MoE layers: {nbytes(result.nbytes)} "
        f"in {result.seconds:.2f} s ({nbytes(rate)}/s), {result.precision} → {result.path}"
    )
    how = [f"{len(result.linked)} hard-linked" if result.linked else "", f"{len(result.copied)} copied" if result.copied else ""]
    typer.echo(f"packed checkpoint: {result.folder} (the checkpoint's other files: "
               f"{', '.join(h for h in how if h) or 'none'}; {checkpoint} is unchanged)")
    typer.echo(f"run it: moekit run {result.folder} \"PROMPT\" --expert-memory 25%")


def _precisions(checkpoint: Path, precision: Optional[str], profile: Optional[Path], hot: Optional[str],
                cold: Optional[str], hot_share: Optional[str]):
    """(layer, expert) → precision from the options, or None (as stored). Checked before any write."""
    from moekit.errors import MoekitError
    from moekit.offload.precision import by_frequency, parse_precision, parse_share, read_counts, uniform
    from moekit.spec.loading import spec_from_config
    from moekit.weights.checkpoint import read_config

    if profile is None and (hot, cold, hot_share) != (None, None, None):
        raise MoekitError("--hot, --cold and --hot-share choose precisions by a profile: give --precision-by-profile too")
    if precision is None and profile is None:
        return None
    if precision is not None and profile is not None:
        raise MoekitError("--precision and --precision-by-profile exclude each other: give one")
    spec = spec_from_config(read_config(checkpoint), checkpoint.name)
    if precision is not None:
        return uniform(spec, parse_precision(precision, "--precision"))
    hot_p, cold_p = parse_precision(hot or "bf16", "--hot"), parse_precision(cold or "int8", "--cold")
    share = parse_share(hot_share or "25%")
    return by_frequency(read_counts(profile, checkpoint, spec), hot_p, cold_p, share)
