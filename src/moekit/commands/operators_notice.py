"""The line a command prints before a run that first builds moekit's CPU operators on this machine:
the build takes about a minute (two on an AVX-512 CPU, which gets an AVX2 build beside) and is
otherwise silent, which reads as a hang."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from moekit.errors import MoekitError

BUILDING = ("building moekit's CPU operators for this machine, once (about a minute, two on a CPU with AVX-512); "
            "later runs load them")


def operators_to_build(needed: bool, kernels: str = "auto", cache: Optional[Path] = None) -> bool:
    """Whether this run builds the operators first: it uses them (`needed`, moekit.engine.loader.
    operators_used), --kernels is auto, and this machine's cache holds no build of these sources."""
    if not needed or kernels != "auto":
        return False
    from moekit.ops.build import DEFAULT_CACHE, is_built, machine_variants

    return not all(is_built(v, cache or DEFAULT_CACHE) for v in machine_variants())


def announce_operator_build(needed: bool, kernels: str = "auto", cache: Optional[Path] = None) -> None:
    """Print BUILDING to stderr where operators_to_build(needed, kernels, cache) (cache: the builds'
    folder, ~/.cache/moekit/ops by default); a --kernels that is neither auto nor reference is
    refused here, before anything loads."""
    if kernels not in ("auto", "reference"):
        raise MoekitError(f"--kernels must be one of auto, reference, got {kernels!r}")
    if operators_to_build(needed, kernels, cache):
        typer.echo(f"note: {BUILDING}...", err=True)


def say_progress(text: str) -> None:
    """A warm-up's progress on stderr: its "..." line, then its time on the same line."""
    typer.echo(text, err=True, nl=not text.endswith("..."))
