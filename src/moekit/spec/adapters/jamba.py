"""jamba: Mamba mixers with an attention layer every `attn_layer_period` (at `attn_layer_offset`),
MoE every `expert_layer_period` (at `expert_layer_offset`); no RoPE anywhere."""

from __future__ import annotations

import math

from moekit.errors import SpecError
from moekit.spec.adapters import common
from moekit.spec.config_fields import ConfigFields
from moekit.spec.model_spec import LayerSpec, MambaSpec, ModelSpec, MoESpec
from moekit.spec.rope import rope_spec

DEFAULTS = {
    "tie_word_embeddings": False,
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "max_position_embeddings": 262144,
    "num_experts_per_tok": 2,
    "num_experts": 16,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": "auto",
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
}


def _period(f: ConfigFields, period_key: str, offset_key: str) -> tuple[int, int]:
    period, offset = f.size(period_key), f.int(offset_key)
    if not 0 <= offset < period:
        raise SpecError(f"jamba config: {offset_key} ({offset}) must be in [0, {period_key} = {period})")
    return period, offset


def _mamba(f: ConfigFields, hidden: int) -> MambaSpec:
    rank = f.get("mamba_dt_rank")
    dt_rank = math.ceil(hidden / 16) if rank == "auto" else f.size("mamba_dt_rank")
    return MambaSpec(
        hidden_size=hidden,
        d_inner=f.size("mamba_expand") * hidden,
        d_state=f.size("mamba_d_state"),
        d_conv=f.size("mamba_d_conv"),
        dt_rank=dt_rank,
        conv_bias=f.bool("mamba_conv_bias"),
        proj_bias=f.bool("mamba_proj_bias"),
    )


def build(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, DEFAULTS, "jamba", {"num_local_experts": "num_experts"})
    hidden, heads, num_layers = f.size("hidden_size"), f.size("num_attention_heads"), f.size("num_hidden_layers")
    attn_period, attn_offset = _period(f, "attn_layer_period", "attn_layer_offset")
    expert_period, expert_offset = _period(f, "expert_layer_period", "expert_layer_offset")
    attention = common.mha(f, head_dim=common.head_dim(f, hidden, heads), use_rope=False)
    mamba = _mamba(f, hidden)
    act = common.activation(f)
    width = f.size("intermediate_size")
    dense = common.gated_mlp(hidden, width, act)
    # A layer with one "expert" is a plain MLP (JambaConfig.layers_num_experts).
    sparse = f.int("num_experts") > 1
    moe = None
    if sparse:
        num_experts, top_k = common.expert_counts(f, "num_experts")
        # softmax over E in fp32, top-K, weights left unnormalised
        moe = MoESpec(router=common.router(num_experts=num_experts, top_k=top_k, normalize=False), expert=dense)
    norm = common.rms_norm(f)
    layers = [
        LayerSpec(
            mixer=attention if i % attn_period == attn_offset else mamba,
            ffn=moe if sparse and i % expert_period == expert_offset else dense,  # type: ignore[arg-type]
            norm=norm,
        )
        for i in range(num_layers)
    ]
    return common.model_spec(f, name, "jamba", layers, rope_spec(f, 10000.0), norm)
