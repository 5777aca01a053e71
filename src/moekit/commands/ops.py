"""`moekit ops build` and `moekit ops status`: moekit's C++ operators built ahead of time (a container
image, CI, the README's set-up), and what is built here, for which CPU, with which kernel for each
kind of weight, and where the compiler's log is when a build failed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from moekit.errors import MoekitError

app = typer.Typer(help="Build moekit's C++ operators ahead of time, and show what is built here.", no_args_is_help=True)

BUILD_HELP = """Build this machine's variants of the operators (the native one, and an AVX2 one beside it on an AVX-512 CPU) into the cache, then measure and keep the kernel choice for each kind of weight.

Each choice is timed once and kept for every later process; one timed while other work shared the cores can be the slower kernel on an idle machine (`moekit ops status` flags it): --remeasure times them all again, best on an idle machine.

  moekit ops build
  moekit ops build --remeasure
"""
STATUS_HELP = """Show torch's version, this CPU's flags, each build (its folder, or the log of a failed one) and the kernel each kind of weight uses here.

  moekit ops status --json
"""
CACHE = "The cache the builds live in (default: ~/.cache/moekit/ops)."


def _cache(cache: Optional[Path]) -> Path:
    from moekit.ops.build import DEFAULT_CACHE

    return cache if cache is not None else DEFAULT_CACHE


@app.command("build", help=BUILD_HELP)
def build(
    cache: Optional[Path] = typer.Option(None, "--cache", help=CACHE),
    cflags: list[str] = typer.Option([], "--extra-cflag", help="One more compiler flag (repeatable), after the variant's own."),
    portable: bool = typer.Option(
        False, "--portable", help="Also build the portable variant (x86-64 without vector extensions), which no run uses: the test suite checks the portable code paths with it."
    ),
    remeasure: bool = typer.Option(
        False, "--remeasure", help="Forget the kernel choices measured before and time them again (run it on an idle machine)."
    ),
) -> None:
    from moekit import ops
    from moekit.commands.operators_notice import BUILDING
    from moekit.ops.build import SCALAR, build as build_variant

    from moekit.ops.select import forget_choices

    if remeasure:
        if cache is not None or cflags:
            raise MoekitError("--remeasure applies to the default cache's builds (choices are kept only there)")
        typer.echo(f"forgot {forget_choices()} kernel choices; measuring again", err=True)
    typer.echo(f"note: {BUILDING}...", err=True)
    loaded = ops.load(_cache(cache), tuple(cflags))
    if not loaded.ok:
        raise MoekitError(loaded.failures()[0])
    for result in loaded.results:
        typer.echo(result.line())
    if portable:
        scalar = build_variant(SCALAR, _cache(cache))
        if not scalar.ok:
            raise MoekitError(scalar.line())
        typer.echo(scalar.line())
    for line in loaded.failures():
        typer.echo(f"warning: {line}", err=True)
    if cache is None and not cflags:  # choices are kept beside the default cache's builds
        for kind, choice in ops.chosen().items():
            typer.echo(f"{kind}: {choice}")
        _warn_busy(_cache(cache))


def _warn_busy(cache: Path) -> None:
    """One warning line where a kept choice was timed on a busy machine."""
    import os

    from moekit.ops.select import busy_choices

    busy = busy_choices(cache)
    if busy:
        worst = max(busy.values())
        typer.echo(f"warning: {len(busy)} kernel choice(s) were measured while the machine was busy (load average up to "
                   f"{worst:g} on {os.cpu_count()} CPUs) and may be the slower kernel on an idle machine: "
                   "run `moekit ops build --remeasure` when it is idle", err=True)


def status_report(cache: Path) -> dict:
    """What `ops status` shows, as data."""
    import torch

    from moekit.ops import build as builds
    from moekit.ops.select import LOADS, choices_path, read_choices

    variants = []
    for v in builds.machine_variants():
        folder = builds.build_dir(v, cache)
        log = builds.log_path(v, cache)
        variants.append({"namespace": v.namespace, "flags": v.flags(), "folder": str(folder),
                         "built": builds.is_built(v, cache), "failed_log": str(log) if log.exists() else None})
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": " ".join(builds.cpu_flags()),
        "cache": str(cache),
        "key": builds.build_key(builds.NATIVE),
        "variants": variants,
        "choices_file": str(choices_path(cache)),
        "choices": {k: v for k, v in read_choices(cache).items() if k != LOADS},
        "measured_at_load": read_choices(cache).get(LOADS, {}),
    }


@app.command("status", help=STATUS_HELP)
def status(
    cache: Optional[Path] = typer.Option(None, "--cache", help=CACHE),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of lines."),
) -> None:
    report = status_report(_cache(cache))
    if json_out:
        typer.echo(json.dumps(report, indent=1))
        return
    typer.echo(f"torch {report['torch']}, CPU {report['cpu_capability']}; cache {report['cache']}")
    typer.echo(f"build key: {report['key']} (torch version, CPU flags' hash, sources' hash)")
    for v in report["variants"]:
        if v["built"]:
            state = f"built in {v['folder']}"
        elif v["failed_log"]:
            state = f"FAILED: the compiler's output is in {v['failed_log']}"
        else:
            state = "not built (moekit ops build, or the first run that uses it, builds it)"
        typer.echo(f"{v['namespace']} ({' '.join(v['flags'])}): {state}")
    if not report["choices"]:
        typer.echo("kernel choices: none measured yet (a run that uses the operators measures them once)")
    loads = report["measured_at_load"]
    for key, value in sorted(report["choices"].items()):
        when = f" (measured at load average {loads[key]:g})" if key in loads else ""
        typer.echo(f"kernel choice: {key} → {value}{when}")
    _warn_busy(_cache(cache))
