"""Decode roofline: how fast a device can possibly generate, and the inverse, the largest model
a per-token latency budget allows.

A decode step reads its bytes (traffic.py) and does its FLOPs; it cannot finish sooner than
bytes / bandwidth nor sooner than FLOPs / peak, whichever is larger binds. FLOPs per token are
2 per parameter touched (one multiply-add; the embedding lookup does none) plus attention over
the context: 2 · heads · (qk_dim + v_dim) per cached token per layer (QKᵀ then AV). Mamba
mixers' context-independent scan is left out (small next to their projections).

`gpus` devices of one kind split weights, KV cache and work evenly and add up their bandwidth
and FLOPs: an upper bound that ignores communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from moekit.calc.dtypes import DType
from moekit.calc.hardware import Hardware
from moekit.calc.kv_cache import cached_tokens
from moekit.calc.memory import MemoryPlan
from moekit.calc.traffic import StepTraffic
from moekit.spec.model_spec import AttentionSpec, ModelSpec


MAX_BATCH = 1 << 20  # where the batch search stops: past any real serving batch


def attention_flops_per_token(spec: ModelSpec, context: int) -> int:
    flops = 0
    for layer in spec.layers:
        att = layer.mixer
        if not isinstance(att, AttentionSpec):
            continue
        if att.kind == "mla":
            qk_dim, v_dim = att.qk_nope_head_dim + att.qk_rope_head_dim, att.v_head_dim
        else:
            qk_dim = v_dim = att.head_dim
        flops += 2 * att.num_heads * (qk_dim + v_dim) * cached_tokens(att, context)
    return flops


@dataclass(frozen=True)
class Bound:
    """One decode step of `batch` tokens on the device(s)."""

    batch: int
    bytes: int
    flops: float
    t_bandwidth: float  # seconds
    t_compute: float
    binds: str  # "bandwidth" or "compute"
    step_seconds: float
    tokens_per_s: float  # upper bound: batch / step_seconds


def step_bound(traffic: StepTraffic, flops_per_token: float, bandwidth: float, peak: float) -> Bound:
    t_bw = traffic.total_bytes / bandwidth
    flops = traffic.batch * flops_per_token
    t_c = flops / peak
    step = max(t_bw, t_c)
    return Bound(
        batch=traffic.batch,
        bytes=traffic.total_bytes,
        flops=flops,
        t_bandwidth=t_bw,
        t_compute=t_c,
        binds="bandwidth" if t_bw >= t_c else "compute",
        step_seconds=step,
        tokens_per_s=traffic.batch / step,
    )


@dataclass(frozen=True)
class Roofline:
    hardware: str
    label: str
    source: str  # where the device's figures come from
    gpus: int
    bandwidth: float  # bytes/s, all devices together
    peak_flops: float  # FLOP/s, all devices together
    peak_dtype: str  # the tensor rate used (may differ from the weight dtype, see hardware.py)
    params_per_token: int  # parameters multiplied per token (no embedding row)
    attention_flops_per_token: int
    flops_per_token: float
    single: Bound  # batch 1
    batched: Bound  # at the requested batch
    capacity_bytes: int  # all devices together
    memory_bytes: int  # the memory plan's total
    per_gpu_bytes: int
    fits: bool


def roofline(
    spec: ModelSpec,
    dtype: DType,
    memory: MemoryPlan,
    single: StepTraffic,
    batched: StepTraffic,
    hardware: Hardware,
    gpus: int,
    context: int,
) -> Roofline:
    peak_dtype, peak = hardware.peak(dtype.compute)
    bandwidth, peak = hardware.bandwidth * gpus, peak * gpus
    params = round(single.dense_params + single.expert_params)
    attention = attention_flops_per_token(spec, context)
    flops_per_token = 2 * params + attention
    capacity = hardware.memory_bytes * gpus
    return Roofline(
        hardware=hardware.name,
        label=hardware.label,
        source=hardware.source,
        gpus=gpus,
        bandwidth=bandwidth,
        peak_flops=peak,
        peak_dtype=peak_dtype,
        params_per_token=params,
        attention_flops_per_token=attention,
        flops_per_token=flops_per_token,
        single=step_bound(single, flops_per_token, bandwidth, peak),
        batched=step_bound(batched, flops_per_token, bandwidth, peak),
        capacity_bytes=capacity,
        memory_bytes=memory.total,
        per_gpu_bytes=math.ceil(memory.total / gpus),
        fits=memory.total <= capacity,
    )


@dataclass(frozen=True)
class SLA:
    """The largest parameter count one token may touch and still decode within the budget at
    batch 1, on this device at this dtype, keeping this model's KV cache, context and embedding
    row. Parameters are counted as `Roofline.params_per_token` is (the DeepSeek / OpenAI
    convention: no input embedding), and the share is of this model's total.

    When that count reaches the whole model (a share above 100%, which no routing can use), the
    useful answers are the headroom and the largest batch this model decodes within the budget."""

    budget_ms: float
    max_params: int
    max_share: float  # above 1 when the budget allows more than this model has (whole_model_fits)
    binds: str  # which bound sets max_params
    bandwidth_limit_params: float
    compute_limit_params: float
    model_params: int
    model_share: float
    model_ms: float
    meets: bool
    whole_model_fits: bool = False  # every parameter on every token would still meet the budget
    headroom: float = 0.0  # budget / this model's batch-1 step: how many times over it meets
    max_batch: int = 0  # the most sequences one decode step serves within the budget (0: not even 1)
    max_batch_binds: str = "latency"  # "latency" (the budget) or "memory" (the devices' capacity)
    # A model that does not fit meets no budget: what would make it fit, and what paging would cost.
    fits_memory: bool = True
    devices_needed: int = 1  # of this kind, at this dtype, to hold the whole memory plan
    expert_memory_bytes: int = 0  # device memory left for routed experts beside everything else
    paged_share: float = 0.0  # of the routed experts' bytes, left on the host
    paged_ms: float = 0.0  # per token at batch 1: the paged share of a token's expert bytes over HOST_LINK
    host_link: str = ""


# The host-to-device link paged experts cross: named, not measured (PCIe 5.0 x16's nominal rate).
HOST_LINK = ("PCIe 5.0 x16", 64e9)


@dataclass(frozen=True)
class Paging:
    """Where a model that does not fit stands: devices to hold it, or experts paged from the host."""

    devices_needed: int
    expert_memory_bytes: int
    paged_share: float
    paged_ms: float


def paging(roof: Roofline, routed_expert_bytes: int, expert_bytes_per_token: float,
           link_bytes_s: float = HOST_LINK[1]) -> Paging:
    """Devices needed at this dtype, and the store's alternative: every routed expert that does not
    fit stays on the host, and a token reads the missing share of its experts over the link (routing
    assumed uniform: a chosen expert is on the host with the paged share's probability)."""
    per_device = roof.capacity_bytes // roof.gpus
    budget = max(0, roof.capacity_bytes - (roof.memory_bytes - routed_expert_bytes))
    share = 0.0 if not routed_expert_bytes else max(0.0, 1 - budget / routed_expert_bytes)
    return Paging(
        devices_needed=-(-roof.memory_bytes // per_device),
        expert_memory_bytes=min(budget, routed_expert_bytes),
        paged_share=share,
        paged_ms=share * expert_bytes_per_token / link_bytes_s * 1000,
    )


def params_within(budget_s: float, roof: Roofline, dtype: DType, single: StepTraffic) -> tuple[float, float]:
    """Invert the batch-1 roofline: (params the bandwidth allows, params the FLOPs allow)."""
    bytes_allowed = budget_s * roof.bandwidth - single.kv_bytes
    by_bandwidth = bytes_allowed * 8 / float(dtype.bits) - single.embedding_row_params
    by_compute = (budget_s * roof.peak_flops - roof.attention_flops_per_token) / 2
    return by_bandwidth, by_compute


def largest_batch(fits: Callable[[int], bool], cap: int = MAX_BATCH) -> int:
    """The largest b in [0, cap] with fits(b), for a fits() true up to some b and false after."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= cap and fits(high):
        low, high = high, high * 2
    high = min(high, cap + 1)  # fits(low) holds; fits(high) fails or high is past the cap
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def batch_within(budget_s: float, roof: Roofline, step_at: Callable[[int], tuple[StepTraffic, int]]) -> tuple[int, str]:
    """(most sequences per decode step within the budget and the devices' memory, which binds).
    step_at(b): the step's traffic and the memory plan's total bytes at batch b."""
    by_latency = largest_batch(
        lambda b: step_bound(step_at(b)[0], roof.flops_per_token, roof.bandwidth, roof.peak_flops).step_seconds
        <= budget_s
    )
    by_memory = largest_batch(lambda b: step_at(b)[1] <= roof.capacity_bytes)
    return (by_latency, "latency") if by_latency <= by_memory else (by_memory, "memory")


def sla(
    budget_ms: float,
    roof: Roofline,
    dtype: DType,
    single: StepTraffic,
    total_params: int,
    step_at: Optional[Callable[[int], tuple[StepTraffic, int]]] = None,
    paged: Optional[Paging] = None,
) -> SLA:
    """The budget inverted; with step_at (see batch_within), also the largest batch it serves."""
    by_bw, by_c = params_within(budget_ms / 1000, roof, dtype, single)
    best = max(0, math.floor(min(by_bw, by_c)))
    model_ms = roof.single.step_seconds * 1000
    batch, batch_binds = batch_within(budget_ms / 1000, roof, step_at) if step_at is not None else (0, "latency")
    return SLA(
        budget_ms=budget_ms,
        max_params=best,
        max_share=best / total_params,
        binds="bandwidth" if by_bw <= by_c else "compute",
        bandwidth_limit_params=by_bw,
        compute_limit_params=by_c,
        model_params=roof.params_per_token,
        model_share=roof.params_per_token / total_params,
        model_ms=model_ms,
        meets=model_ms <= budget_ms and roof.fits,
        whole_model_fits=best >= total_params,
        headroom=budget_ms / model_ms,
        max_batch=batch,
        max_batch_binds=batch_binds,
        fits_memory=roof.fits,
        **({} if paged is None else {"devices_needed": paged.devices_needed,
                                     "expert_memory_bytes": paged.expert_memory_bytes,
                                     "paged_share": paged.paged_share, "paged_ms": paged.paged_ms,
                                     "host_link": f"{HOST_LINK[0]}, {HOST_LINK[1] / 1e9:g} GB/s nominal"}),
    )
