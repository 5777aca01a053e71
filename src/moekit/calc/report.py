"""One model's full calculation (counts, memory, traffic, roofline, SLA) and its JSON / CSV shape."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from moekit.calc.hardware import Hardware
from moekit.calc.memory import MemoryPlan, memory_plan
from moekit.calc.params import ParamCounts, count_params
from moekit.calc.request import CalcRequest
from moekit.calc import units as u
from moekit.calc.roofline import SLA, Bound, Roofline, paging, roofline, sla
from moekit.calc.traffic import StepTraffic, step_traffic
from moekit.spec.model_spec import ModelSpec


@dataclass(frozen=True)
class ModelReport:
    spec: ModelSpec
    request: CalcRequest
    counts: ParamCounts
    memory: MemoryPlan
    single: StepTraffic  # batch 1
    batched: StepTraffic  # at request.batch
    roofline: Optional[Roofline] = None
    sla: Optional[SLA] = None


def build_report(spec: ModelSpec, request: CalcRequest, hardware: Optional[Hardware] = None) -> ModelReport:
    counts = count_params(spec)
    plan = memory_plan(spec, counts, request.dtype, request.kv_dtype, request.context, request.batch)
    single = step_traffic(spec, counts, request.dtype, plan.kv, 1)
    batched = step_traffic(spec, counts, request.dtype, plan.kv, request.batch)
    roof = budget = None
    if hardware is not None:
        roof = roofline(spec, request.dtype, plan, single, batched, hardware, request.gpus, request.context)
        if request.sla_ms is not None:
            paged = paging(roof, plan.weights.routed_experts, request.dtype.bytes_for(round(single.expert_params)))
            budget = sla(request.sla_ms, roof, request.dtype, single, counts.total_params, step_at_batch(spec, counts, request),
                         paged)
    return ModelReport(spec, request, counts, plan, single, batched, roof, budget)


def step_at_batch(spec: ModelSpec, counts: ParamCounts, request: CalcRequest):
    """Batch b → (one decode step's traffic, the memory plan's total), at the request's dtypes and context."""

    def at(batch: int) -> tuple[StepTraffic, int]:
        plan = memory_plan(spec, counts, request.dtype, request.kv_dtype, request.context, batch)
        return step_traffic(spec, counts, request.dtype, plan.kv, batch), plan.total

    return at


def _traffic_dict(t: StepTraffic) -> dict:
    return {
        "batch": t.batch,
        "params_read": round(t.params_read),
        "distinct_experts_per_layer": t.distinct_experts_per_layer,
        "weight_bytes": t.weight_bytes,
        "kv_bytes": t.kv_bytes,
        "total_bytes": t.total_bytes,
    }


def _bound_dict(b: Bound) -> dict:
    return {
        "batch": b.batch,
        "bytes": b.bytes,
        "flops": b.flops,
        "bandwidth_ms": b.t_bandwidth * 1000,
        "compute_ms": b.t_compute * 1000,
        "binds": b.binds,
        "step_ms": b.step_seconds * 1000,
        "tokens_per_s": b.tokens_per_s,
    }


def report_dict(r: ModelReport) -> dict:
    c, m = r.counts, r.memory
    out = {
        "model": r.spec.name,
        "model_type": r.spec.model_type,
        "total_params": c.total_params,
        "active_params": c.active_params,
        "active_params_excl_input_embedding": c.active_params_excl_input_embedding,
        "active_params_non_embedding": c.active_params_non_embedding,
        "active_fraction": c.active_fraction,
        "breakdown": asdict(c.breakdown),
        "memory": {
            "dtype": m.weights.dtype,
            "kv_dtype": m.kv.dtype,
            "context": m.kv.context,
            "batch": m.kv.batch,
            "weight_bytes": m.weights.total,
            "resident_weight_bytes": m.weights.resident,
            "routed_expert_bytes": m.weights.routed_experts,
            "mtp_bytes": m.weights.mtp,
            "vision_bytes": m.weights.vision,
            "kv_bytes_per_token": m.kv.bytes_per_token,
            "kv_bytes_per_sequence": m.kv.bytes_per_sequence,
            "kv_bytes": m.kv.total_bytes,
            "activation_bytes": m.activations,
            "total_bytes": m.total,
        },
        "traffic": {"batch1": _traffic_dict(r.single), "batch": _traffic_dict(r.batched)},
    }
    if r.roofline is not None:
        f = r.roofline
        out["roofline"] = {
            "hardware": f.hardware,
            "label": f.label,
            "source": f.source,
            "gpus": f.gpus,
            "bandwidth_bytes_per_s": f.bandwidth,
            "peak_flops": f.peak_flops,
            "peak_dtype": f.peak_dtype,
            "flops_per_token": f.flops_per_token,
            "attention_flops_per_token": f.attention_flops_per_token,
            "batch1": _bound_dict(f.single),
            "batch": _bound_dict(f.batched),
            "capacity_bytes": f.capacity_bytes,
            "per_gpu_bytes": f.per_gpu_bytes,
            "fits": f.fits,
        }
    if r.sla is not None:
        out["sla"] = asdict(r.sla)
    return out


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested report → one CSV row: keys joined with dots."""
    row = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            row.update(flatten(value, f"{name}."))
        else:
            row[name] = value
    return row


def not_fitting(r: ModelReport, s) -> str:
    """What would make a model that does not fit true to its budget: more devices, or the expert store
    paging from the host at a stated cost per token."""
    gpus = f"needs --gpus {s.devices_needed} at {r.request.dtype.name}"
    if not s.expert_memory_bytes:
        return gpus + " (even without its routed experts it does not fit)"
    total = s.model_ms + s.paged_ms
    return (f"{gpus}; or --expert-memory {u.nbytes(s.expert_memory_bytes)} with {u.pct(s.paged_share)} of the experts "
            f"paged from host: +{u.ms(s.paged_ms / 1000)} per token over {s.host_link} = {u.ms(total / 1000)}, "
            f"{'meets' if total <= s.budget_ms else 'misses'} the budget")
