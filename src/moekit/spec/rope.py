"""RoPE settings from either config style, normalised the way transformers 5 normalises them.

Hub configs written before transformers 5 carry `rope_theta` + `rope_scaling`; newer ones carry one
`rope_parameters` dict. transformers merges them (`RotaryEmbeddingConfigMixin`): `rope_scaling`
wins over `rope_parameters`, a theta inside the dict wins over a top-level `rope_theta`, which wins
over the family's `default_theta`; scaled types learn `original_max_position_embeddings`.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

from moekit.errors import SpecError
from moekit.spec.config_fields import ConfigFields
from moekit.spec.model_spec import RopeSpec

# Types whose inverse frequencies depend on the pretraining length (transformers' own list).
_NEEDS_ORIGINAL_MAX = ("llama3", "yarn", "longrope")


def _hashable(value: object) -> object:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def rope_parameters(f: ConfigFields, default_theta: float, default_params: Optional[Mapping] = None) -> dict:
    """The merged `rope_parameters` dict transformers ends up with for this config."""
    scaling = f.raw.get("rope_scaling")
    params = scaling or f.raw.get("rope_parameters") or default_params or {}
    if not isinstance(params, Mapping):
        raise SpecError(f"{f.family} config: 'rope_parameters' must be an object, got {params!r}")
    params = dict(params)
    theta = f.raw.get("rope_theta", default_theta)
    params.setdefault("rope_theta", theta)
    if "partial_rotary_factor" in f.raw:
        params.setdefault("partial_rotary_factor", f.raw["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _NEEDS_ORIGINAL_MAX:
        if "original_max_position_embeddings" in f.raw:
            params["original_max_position_embeddings"] = f.raw["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", f.get("max_position_embeddings"))
    return params


def rope_spec(f: ConfigFields, default_theta: float, default_params: Optional[Mapping] = None) -> RopeSpec:
    params = rope_parameters(f, default_theta, default_params)
    theta = params["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise SpecError(f"{f.family} config: 'rope_theta' must be a positive number, got {theta!r}")
    partial = params.get("partial_rotary_factor", 1.0)
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise SpecError(f"{f.family} config: 'partial_rotary_factor' must be in (0, 1], got {partial!r}")
    rest = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
    scaling = None if rest.get("rope_type") == "default" else tuple(sorted((k, _hashable(v)) for k, v in rest.items()))
    return RopeSpec(theta=float(theta), scaling=scaling, partial_rotary_factor=float(partial))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction, 0.1·m·ln(scale) + 1; DeepSeek squares it into the softmax scale."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(rope: RopeSpec, head_dim: int) -> Optional[float]:
    """DeepSeek's attention scale under YaRN: 1/sqrt(d) × mscale², mscale = 0.1·m·ln(factor) + 1.

    None when no correction applies (the usual 1/sqrt(d)). Mirrors transformers' `yarn_apply_mscale`.
    """
    params = rope.scaling_dict()
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if not params or not mscale_all_dim:
        return None
    mscale = yarn_mscale(params["factor"], mscale_all_dim)
    return head_dim**-0.5 * mscale * mscale
