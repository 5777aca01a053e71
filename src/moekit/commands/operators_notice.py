"""The line a command prints before a run that first builds moekit's CPU operators on this machine:
the build takes about a minute (twice on an AVX-512 CPU, which gets an AVX2 build beside) and is
otherwise silent, which reads as a hang."""

from __future__ import annotations

import typer

BUILDING = ("building moekit's CPU operators for this machine, once (about a minute, two on a CPU with AVX-512); "
            "later runs load them")


def operators_needed(compile_step: bool, weights: str, dtype: str, paged: bool) -> bool:
    """Whether a run with these options uses the operators: the compiled step, int8 weights (any
    `--weights` but "dtype") or the expert store at fp32 (`paged`), whose misses they lay out."""
    return compile_step or weights != "dtype" or (paged and dtype == "float32")


def operators_to_build(needed: bool) -> bool:
    """Whether this run builds the operators first: it uses them (`needed`, operators_needed) and
    this machine holds no build of this version yet."""
    if not needed:
        return False
    from moekit.model import gemv

    return not gemv.built_here()


def announce_operator_build(needed: bool) -> None:
    """Print BUILDING to stderr where operators_to_build(needed)."""
    if operators_to_build(needed):
        typer.echo(f"note: {BUILDING}...", err=True)
