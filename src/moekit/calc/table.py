"""The default human view: one rich table, a row per figure, a column per model, so several
models read side by side."""

from __future__ import annotations

from typing import Callable, Optional

from rich.table import Table

from moekit.calc import units as u
from moekit.calc.claims import uniform_moe
from moekit.calc.report import ModelReport, not_fitting

Cell = Callable[[ModelReport], Optional[str]]


def _experts(r: ModelReport) -> str:
    moe = uniform_moe(r.spec)
    n_moe = len(r.spec.moe_layers)
    if moe is None:
        return f"{n_moe} MoE layers (mixed)" if n_moe else "none (dense)"
    shared = f" + {moe.num_shared or 1} shared" if moe.shared is not None else ""
    return f"{moe.top_k} of {moe.num_experts}{shared}, {n_moe}/{r.spec.num_layers} layers"


def _share(value: int, r: ModelReport) -> str:
    return f"{u.params(value)} ({u.pct(value / r.counts.total_params)})"


def _roof(fn: Callable) -> Cell:
    return lambda r: fn(r, r.roofline) if r.roofline is not None else None


def _sla(fn: Callable) -> Cell:
    return lambda r: fn(r, r.sla) if r.sla is not None else None


def rows(batch: int) -> list[tuple[str, Cell]]:
    table: list[tuple[str, Cell]] = [
        ("model_type", lambda r: r.spec.model_type),
        ("experts per token", _experts),
        ("total params", lambda r: u.params(r.counts.total_params)),
        ("active params (share)", lambda r: _share(r.counts.active_params, r)),
        ("active excl. input embedding", lambda r: _share(r.counts.active_params_excl_input_embedding, r)),
        ("active non-embedding", lambda r: _share(r.counts.active_params_non_embedding, r)),
        ("MTP / vision (apart)", lambda r: _apart(r)),
        ("weights", lambda r: f"{u.nbytes(r.memory.weights.total)} @ {r.memory.weights.dtype}"),
        ("  always resident", lambda r: u.nbytes(r.memory.weights.resident)),
        ("  routed experts", lambda r: u.nbytes(r.memory.weights.routed_experts)),
        ("KV cache per token", lambda r: u.nbytes(r.memory.kv.bytes_per_token)),
        ("KV cache", lambda r: f"{u.nbytes(r.memory.kv.total_bytes)} @ {r.memory.kv.context:,} × {r.memory.kv.batch}"),
        ("activations (rough)", lambda r: u.nbytes(r.memory.activations)),
        ("memory total", lambda r: u.nbytes(r.memory.total)),
        ("read per token, batch 1", lambda r: u.nbytes(r.single.total_bytes)),
    ]
    if batch > 1:
        table.append((f"read per step, batch {batch}", lambda r: u.nbytes(r.batched.total_bytes)))
        table.append(("  distinct experts / layer", lambda r: f"{r.batched.distinct_experts_per_layer:.2f}"))
    table += [
        ("hardware", _roof(lambda r, f: f"{f.gpus} × {f.hardware}" if f.gpus > 1 else f.hardware)),
        ("fits in memory", _roof(lambda r, f: f"{'yes' if f.fits else 'NO'} ({u.nbytes(f.per_gpu_bytes)}/device)")),
        ("per token, batch 1", _roof(lambda r, f: f"{u.ms(f.single.step_seconds)} ({f.single.binds})")),
        ("tokens/s, batch 1 (max)", _roof(lambda r, f: f"{f.single.tokens_per_s:,.1f}")),
    ]
    if batch > 1:
        table += [
            (f"step, batch {batch}", _roof(lambda r, f: f"{u.ms(f.batched.step_seconds)} ({f.batched.binds})")),
            (f"tokens/s, batch {batch} (max)", _roof(lambda r, f: f"{f.batched.tokens_per_s:,.1f}")),
        ]
    table += [
        ("SLA budget", _sla(lambda r, s: f"{s.budget_ms:g} ms/token")),
        ("  max params per token", _sla(_max_params)),
        ("  this model", _sla(_this_model)),
        ("  max batch in budget", _sla(_max_batch)),
    ]
    return table


def _max_params(r: ModelReport, s) -> str:
    if s.whole_model_fits:  # a share above 100% means nothing: say what it does mean
        return f"all {u.params(r.counts.total_params)}: whole model fits"
    return f"{u.params(s.max_params)} ({u.pct(s.max_share)} of total)"


def _this_model(r: ModelReport, s) -> str:
    if not s.fits_memory:
        return f"{u.ms(s.model_ms / 1000)} if it fit: does NOT fit, {not_fitting(r, s)}"
    verdict = f"meets ({s.headroom:,.1f}× headroom)" if s.meets else "MISSES"
    return f"{u.ms(s.model_ms / 1000)}: {verdict}"



def _max_batch(r: ModelReport, s) -> Optional[str]:
    if s.max_batch == 0:
        return None
    return f"{s.max_batch:,} ({'budget' if s.max_batch_binds == 'latency' else 'memory'} binds)"


def _apart(r: ModelReport) -> Optional[str]:
    b = r.counts.breakdown
    parts = [f"MTP {u.params(b.mtp)}" if b.mtp else "", f"vision {u.params(b.vision)}" if b.vision else ""]
    parts = [p for p in parts if p]
    return ", ".join(parts) if parts else None


def report_table(reports: list[ModelReport]) -> Table:
    table = Table(show_header=True, header_style="bold")
    table.add_column("")
    for r in reports:
        table.add_column(r.spec.name, justify="right")
    for label, cell in rows(reports[0].request.batch):
        values = [cell(r) for r in reports]
        if any(v is not None for v in values):
            table.add_row(label, *[v or "" for v in values])
    return table
