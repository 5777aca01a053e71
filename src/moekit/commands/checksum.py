"""`moekit checksum`: write (or complete, or check) moekit-experts.json beside a checkpoint.

No torch: the manifest is plain byte ranges and crc32s (moekit.weights.manifest).
"""

from __future__ import annotations

from pathlib import Path

import typer


HELP = """Checksum a checkpoint so that every later load verifies what it reads.

Writes moekit-experts.json beside config.json: a crc32 of every routed expert and of every other tensor (attention, norms, embeddings, routers, shared experts). From then on `moekit run`, `serve`, `bench decode`, `eval` and `moekit.load` check each weight as they read it, resident or with --expert-memory, and refuse a changed file with one line naming the tensor or expert and the file (exit 2); --no-verify skips the check. Nothing else in the folder is touched.

With a manifest already there: one from an earlier moekit (routed experts only) gets the other tensors' checksums added; a complete one is checked against the files, every byte, and nothing is written.

Examples:

  moekit checksum path/to/checkpoint

  moekit run path/to/checkpoint "Hello"               # verified as it loads

  moekit run path/to/checkpoint "Hello" --no-verify   # skip the check

A GGUF file is checksummed the same way into x.gguf.moekit-experts.json beside it (the .gguf is never written):

  moekit checksum model.gguf
"""


def checksum(
    checkpoint: Path = typer.Argument(..., help="Checkpoint folder (config.json + *.safetensors) or a .gguf file; "
                                      "only the manifest (moekit-experts.json, or x.gguf.moekit-experts.json) is written."),
) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from moekit.calc.units import nbytes
    from moekit.weights.manifest import checksum_checkpoint
    from moekit.spec.loading import spec_from_config
    from moekit.weights.checkpoint import read_config

    if checkpoint.suffix == ".gguf" and checkpoint.is_file():  # its manifest beside it (moekit.weights.gguf_extents)
        from moekit.weights.gguf_extents import checksum_gguf
        from moekit.weights.gguf_spec import spec_from_gguf

        spec = spec_from_gguf(checkpoint)
        run = lambda progress: checksum_gguf(checkpoint, spec, progress)  # noqa: E731
    else:
        spec = spec_from_config(read_config(checkpoint), checkpoint.name)
        run = lambda progress: checksum_checkpoint(checkpoint, spec, progress)  # noqa: E731
    columns = (TextColumn("checksumming"), BarColumn(), MofNCompleteColumn())
    console = Console(stderr=True)
    # Off when stderr is no terminal: a finished transient bar still leaves a newline behind.
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("checksum", total=None)
        result = run(lambda n, of: bar.update(task, completed=n, total=of))
    what = f"{result.experts} routed experts and {result.tensors} other tensors" if result.experts else f"{result.tensors} tensors"
    took = f"{nbytes(result.nbytes)} in {result.seconds:.2f} s"
    if result.note:
        typer.echo(f"note: whole tensors only, no expert extents ({result.note})", err=True)
    if result.action == "verified":
        typer.echo(f"{result.path}: {what} match ({took}); nothing written")
    elif result.action == "added":
        typer.echo(f"{result.path}: added checksums of {result.tensors} tensors to the routed experts' ({took})")
    else:
        typer.echo(f"wrote {result.path}: {what} checksummed ({took})")
