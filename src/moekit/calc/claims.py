"""Published claims a config carries in its `_claims` field (the gpt4-rumored preset does), and
the arithmetic that tests them: the share the model's own figures imply, and what it would take
to reach the claimed share.

Keyed on data, never on a model's name: any config.json with a `_claims` object gets the same
section in `--explain`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional

from moekit.calc.params import ParamCounts
from moekit.errors import SpecError
from moekit.spec.model_spec import ModelSpec, MoESpec


@dataclass(frozen=True)
class Claims:
    source: str
    total_params: Optional[float] = None
    active_params: Optional[float] = None
    slogan: Optional[str] = None
    slogan_active_share: Optional[float] = None  # e.g. 0.02 for "uses 2%"


def _number(claims: dict, key: str, where: str) -> Optional[float]:
    value = claims.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise SpecError(f"{where}: '_claims.{key}' must be a positive number, got {value!r}")
    return float(value)


def claims_from_config(config: dict, where: str) -> Optional[Claims]:
    raw = config.get("_claims")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: '_claims' must be an object, got {type(raw).__name__}")
    share = _number(raw, "slogan_active_share", where)
    if share is not None and share >= 1:
        raise SpecError(f"{where}: '_claims.slogan_active_share' is a fraction below 1, got {share}")
    return Claims(
        source=str(raw.get("source", "unstated")),
        total_params=_number(raw, "total_params", where),
        active_params=_number(raw, "active_params", where),
        slogan=raw.get("slogan") if isinstance(raw.get("slogan"), str) else None,
        slogan_active_share=share,
    )


def raw_config(source: str, presets: list[str]) -> Optional[dict]:
    """The JSON behind a source `load_spec` already accepted (preset, file or folder)."""
    if source in presets:
        text = resources.files("moekit.spec").joinpath("presets", f"{source}.json").read_text()
    else:
        path = Path(source)
        if path.suffix == ".gguf" and path.is_file():  # a GGUF's metadata is no config.json, and states no claims
            return None
        path = path / "config.json" if path.is_dir() else path
        text = path.read_text()
    config = json.loads(text)
    return config if isinstance(config, dict) else None


@dataclass(frozen=True)
class ShareAnalysis:
    """What share a model's figures imply, and which changes would reach `target`.

    Notation: A = always-on parameters (every active parameter but the routed experts), e = one
    routed expert summed over all MoE layers, E experts of which K per token. Share = active /
    total = (A + K·e) / (A + E·e).
    """

    target: float
    total: int
    active: int
    share: float
    always_on: int  # A
    attention: int
    expert_all_layers: float  # e
    num_experts: int  # E
    top_k: int  # K
    routing_floor: float  # K / E: the share with no always-on part at all
    experts_needed: float  # E giving `target` at the same K, e and A
    budget_at_same_total: float  # target × total

    @property
    def total_if_experts_needed(self) -> float:
        return self.always_on + self.experts_needed * self.expert_all_layers

    @property
    def always_on_share(self) -> float:
        return self.always_on / self.total

    @property
    def attention_share(self) -> float:
        return self.attention / self.total


def uniform_moe(spec: ModelSpec) -> Optional[MoESpec]:
    """The MoE block every MoE layer shares, or None when layers differ (or there are none)."""
    blocks = {layer.ffn for layer in spec.layers if isinstance(layer.ffn, MoESpec)}
    return blocks.pop() if len(blocks) == 1 else None


def share_analysis(spec: ModelSpec, counts: ParamCounts, target: float) -> Optional[ShareAnalysis]:
    moe = uniform_moe(spec)
    if moe is None:
        return None
    b = counts.breakdown
    e = b.routed_experts_total / moe.num_experts
    always_on = counts.active_params - b.routed_experts_active
    k = moe.top_k
    return ShareAnalysis(
        target=target,
        total=counts.total_params,
        active=counts.active_params,
        share=counts.active_fraction,
        always_on=always_on,
        attention=b.attention,
        expert_all_layers=e,
        num_experts=moe.num_experts,
        top_k=k,
        routing_floor=k / moe.num_experts,
        experts_needed=((always_on + k * e) / target - always_on) / e,
        budget_at_same_total=target * counts.total_params,
    )
