"""`moekit bench` around its harness: `bench decode`'s progress, batch by batch, and `bench
offload`'s checks before any run (a run takes seconds on the demo model, minutes on a real one)
and its summary table fitted to the terminal. Works on settings and summary rows, wherever the
harness lives."""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from moekit.calc.units import nbytes
from moekit.errors import MoekitError

# The engine's fixed working memory (oneDNN primitive cache, activations, load buffers) was
# 20-30 MB here: an RSS bound much below a few times that cannot hold, whatever the store does.
SMALL_BOUND_BYTES = 256 * 1024**2
BASELINE_MODULES = {"accelerate": ("accelerate", "transformers")}


def decode_in_steps(run: Callable, settings, baseline: Optional[str], echo: Callable[[str], None]) -> list:
    """run(settings) once per batch size, saying before each what it measures: the same results
    as one call (each batch has its own prompts and warm-up), with progress in between."""
    began, results = time.perf_counter(), []
    sides = f"moekit and {baseline}" if baseline else "moekit"
    for i, batch in enumerate(settings.batches, start=1):
        echo(f"[bench decode] batch {batch} ({i} of {len(settings.batches)}): {sides}, {settings.warmup} warm-up + "
             f"{settings.repeats} timed run(s) of {settings.tokens} tokens")
        results += run(dataclasses.replace(settings, batches=(batch,)))
    echo(f"[bench decode] done in {time.perf_counter() - began:.1f} s")
    return results


def check_offload_request(folder: Path, dtype: str, budgets: tuple[str, ...], policy: str, vs: Optional[str]) -> str:
    """Refuse now what a run would refuse later: a budget or policy the store rejects, a baseline
    that is not installed. Returns the minimum budget (K experts per MoE layer, in bytes), the
    no-cache baseline's."""
    from moekit.engine.loader import torch_dtype
    from moekit.offload.attach import expert_nbytes, moe_layers, plan_offload
    from moekit.offload.options import OffloadOptions
    from moekit.weights.gguf_spec import load_any_spec

    spec = load_any_spec(folder)
    layers = moe_layers(spec)
    if not layers:
        raise MoekitError(f"{folder}: a dense model has no routed experts to offload")
    weights = torch_dtype(dtype)
    for budget in budgets:
        plan_offload(spec, weights, OffloadOptions(expert_memory=budget, policy=policy))
    missing = [m for m in BASELINE_MODULES.get(vs or "", ()) if importlib.util.find_spec(m) is None]
    if missing:
        raise MoekitError(f"--vs {vs} needs {' and '.join(missing)}, which is not installed "
                          "(pip install -e '.[test]' installs the pinned baselines)")
    k = spec.layers[layers[0]].ffn.router.top_k
    return str(k * len(layers) * expert_nbytes(spec, weights))


def _pct(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.1%}"


def _ratio(x: Optional[float], spec: str) -> str:
    return "—" if x is None else f"{format(x, spec)}×"


@dataclass(frozen=True)
class Column:
    name: str
    cell: Callable[[dict], str]
    default: bool = False  # shown without --wide
    accelerate: bool = False  # only with --vs accelerate
    wide: bool = True  # shown with --wide


COLUMNS = (
    Column("budget", lambda r: r["budget"], default=True),
    Column("tok/s", lambda r: f"{r['tokens_per_s']:.1f}", default=True),
    Column("× resident", lambda r: _ratio(r["vs_resident"], ".2f"), default=True),
    Column("× no cache", lambda r: _ratio(r["vs_no_cache"], ".2f"), default=True),
    Column("accelerate tok/s", lambda r: "—" if r["accelerate_tokens_per_s"] is None
           else f"{r['accelerate_tokens_per_s']:.2f}", accelerate=True),
    Column("× accelerate", lambda r: _ratio(r["vs_accelerate"], ".1f"), default=True, accelerate=True),
    Column("hit rate", lambda r: _pct(r["hit_rate"]), default=True),
    Column("disk / token", lambda r: "—" if r["disk_bytes_per_token"] is None else nbytes(r["disk_bytes_per_token"]),
           default=True),
    Column("stall share", lambda r: _pct(r["stall_share"])),
    # Within the bound? The figures are --wide's "RSS growth / bound"; the notes say why not.
    Column("peak RSS", lambda r: "ok" if r["rss_ok"] else "OVER", default=True, wide=False),
    Column("RSS growth / bound", lambda r: f"{nbytes(r['rss_growth_bytes'])} / {nbytes(r['rss_bound_bytes'])}"
           f" {'ok' if r['rss_ok'] else 'OVER'}"),
    Column("prefetch tok/s", lambda r: "—" if r["prefetch_tokens_per_s"] is None
           else f"{r['prefetch_tokens_per_s']:.1f}"),
    Column("prefetch hit rate", lambda r: _pct(r["prefetch_hit_rate"])),
    Column("recall / precision", lambda r: f"{_pct(r['prefetch_recall'])} / {_pct(r['prefetch_precision'])}"),
    Column("same tokens", lambda r: "yes" if r["same_tokens"] else "NO", default=True),
)


def offload_columns(vs_accelerate: bool, wide: bool) -> list[Column]:
    return [c for c in COLUMNS if (c.wide if wide else c.default) and (vs_accelerate or not c.accelerate)]


def offload_table(title: str, rows: list[dict], vs_accelerate: bool, wide: bool):
    """Cells never wrap or shorten (each column is at least as wide as its widest figure); the
    headers wrap at their spaces instead, which is what lets the default columns fit 110."""
    from rich.table import Table

    columns = offload_columns(vs_accelerate, wide)
    cells = [[c.cell(r) for c in columns] for r in rows]
    table = Table(title=title)
    for i, c in enumerate(columns):
        widest = max((len(row[i]) for row in cells), default=0)
        table.add_column(c.name, justify="right", min_width=max(widest, *map(len, c.name.split())))
    for row in cells:
        table.add_row(*row)
    return table


def offload_notes(rows: list[dict], wide: bool) -> list[str]:
    """What the table cannot say in a cell: why a bound is over, where the other columns are."""
    notes = []
    over = [r for r in rows if not r["rss_ok"]]
    if over:
        budgets = ", ".join(r["budget"] for r in over)
        if all(r["rss_bound_bytes"] < SMALL_BOUND_BYTES for r in over):
            notes.append(
                f"peak RSS OVER at {budgets}: its growth went past (dense weights + budget) × 1.1, which is "
                f"{nbytes(max(r['rss_bound_bytes'] for r in over))} at most here, and the engine's fixed working "
                "memory (oneDNN primitive cache, activations, read buffers: tens of MB) does not shrink with the "
                "model; the bound is meant for models whose weights dwarf it (docs/BENCHMARKS.md)"
            )
        else:
            notes.append(f"peak RSS OVER at {budgets}: its growth went past (dense weights + budget) × 1.1")
    if not wide:
        notes.append("--wide adds the RSS figures, stall share and the prefetch runs; --json has every figure")
    return notes


def print_wide_or_fitted(console, table, wide: bool) -> None:
    """A fitted table prints at the terminal's width; --wide never squeezes a cell, whatever the width."""
    if wide:
        from rich.console import Console
        from rich.measure import Measurement

        need = Measurement.get(console, console.options.update_width(10**4), table).maximum
        console = Console(width=max(console.width, need), file=console.file, color_system=console.color_system)
    console.print(table)
