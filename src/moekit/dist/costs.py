"""The simulator's cost inputs from a model spec and a catalog device (no torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from moekit.calc.dtypes import DTYPES, dtype_choice
from moekit.dist.simulate import Cost, links_for
from moekit.errors import MoekitError

WIRE_DTYPES = ("fp32", "bf16", "fp8")  # values on the wire and in the experts


def check_dtype(dtype: str) -> str:
    """--dtype in the one vocabulary (bf16, bfloat16, ...) as its canonical name."""
    return dtype_choice(dtype, WIRE_DTYPES)


def spec_facts(spec) -> tuple[int, int, dict[int, int], int, int]:
    """(D, one routed expert's params, MoE layer → E, K, router groups) of a ModelSpec."""
    layers = spec.moe_layers
    if not layers:
        raise MoekitError(f"{spec.name}: a dense model has no routed experts")
    ffn = spec.layers[layers[0]].ffn
    expert = ffn.expert
    return (spec.hidden_size, _expert_params(expert.hidden_size, expert.width, expert.gated),
            {l: spec.layers[l].ffn.num_experts for l in layers}, ffn.top_k, ffn.router.n_group)


def trace_facts(model) -> Optional[tuple[int, int, dict[int, int], int, int]]:
    """spec_facts from what a trace's metadata records (a moekit.engine.trace.TraceModel), or None
    when it predates the shapes being recorded."""
    if model is None or None in (model.hidden_size, model.expert_width, model.expert_gated) or not model.experts:
        return None
    first = min(model.experts)
    return (model.hidden_size, _expert_params(model.hidden_size, model.expert_width, model.expert_gated),
            dict(model.experts), model.top_k[first], model.router_groups or 1)


def _expert_params(hidden: int, width: int, gated: bool) -> int:
    """One routed expert's weights: gate (if gated), up and down, D × F each."""
    return ((2 if gated else 1) * width + width) * hidden


def bundled_model_for(config_sha256: Optional[str]) -> Optional[str]:
    """The bundled demo model's folder when a trace's config fingerprint is its config.json's."""
    import hashlib

    from moekit.engine.default_model import bundled_model_path

    folder = bundled_model_path()
    config = folder / "config.json"
    if config_sha256 and config.is_file() and hashlib.sha256(config.read_bytes()).hexdigest() == config_sha256:
        return str(folder)
    return None


def make_cost(d: int, expert_params: int, dtype: str, hardware: Optional[str]) -> Cost:
    size = int(DTYPES[check_dtype(dtype)].bits) // 8
    if hardware is None:
        return Cost(row_bytes=d * size, expert_bytes=expert_params * size, expert_params=expert_params)
    from moekit.calc.hardware import get_hardware

    hw = get_hardware(hardware)
    _, flops = hw.peak(DTYPES[check_dtype(dtype)].compute)
    return Cost(row_bytes=d * size, expert_bytes=expert_params * size, expert_params=expert_params,
                hbm=hw.bandwidth, flops=flops, links=links_for(hw.name), memory=hw.memory_bytes)
