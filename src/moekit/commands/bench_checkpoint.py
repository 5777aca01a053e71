"""`moekit bench make-checkpoint`: a random-weight checkpoint at a published shape, for the real-size runs."""

from __future__ import annotations

from pathlib import Path

import typer

from moekit.errors import MoekitError

HELP = """Write a random-weight checkpoint at a published shape (a preset or a config.json), streamed to disk.

Formats: safetensors-bf16 (Hub layout), mxfp4 (gpt-oss as published), gguf-q8_0, gguf-mxfp4 (llama.cpp's
gpt-oss file). Routing is uniform (every router row drawn alike). Sizes: gpt-oss-20b mxfp4 ≈ 13 GB,
qwen3-30b-a3b gguf-q8_0 ≈ 32 GB: check `df -h` first.

  moekit bench make-checkpoint --shape qwen3-30b-a3b --format gguf-q8_0 --out big/qwen3-30b-a3b-q8_0.gguf
  moekit bench make-checkpoint --shape gpt-oss-20b --format mxfp4 --out big/gpt-oss-20b
"""


def make_checkpoint(
    shape: str = typer.Option(..., "--shape", help="A preset name (moekit calc --list) or a config.json path."),
    fmt: str = typer.Option(..., "--format", help="safetensors-bf16, mxfp4, gguf-q8_0 or gguf-mxfp4."),
    out: Path = typer.Option(..., "--out", help="A new folder (safetensors forms) or a *.gguf file path."),
    seed: int = typer.Option(0, "--seed", help="The draw: one seed gives the same weights in every form of a shape."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="A progress bar on stderr."),
) -> None:
    from moekit.bench.make_checkpoint import make_checkpoint as write
    from moekit.spec.loading import load_config

    written = write(load_config(shape)[0], fmt, out, seed=seed, progress=progress)
    if written.nbytes <= 0:
        raise MoekitError(f"{out}: nothing was written")
    from moekit.calc import units

    typer.echo(f"{written.path}: {units.params(written.params)} parameters, {units.nbytes(written.nbytes)}")
