"""phimoe: mixtral's shape with LayerNorms (with bias), sparsemixer routing and an optional
lm_head bias."""

from __future__ import annotations

from moekit.spec.adapters import common
from moekit.spec.model_spec import LayerSpec, ModelSpec, MoESpec, NormSpec
from moekit.spec.rope import rope_spec

DEFAULTS = {
    "intermediate_size": 6400,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "num_experts_per_tok": 2,
    "num_local_experts": 16,
    "router_jitter_noise": 0.01,
    "attention_bias": False,
    "lm_head_bias": False,
}
DEFAULT_THETA = 1e6


def build(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, DEFAULTS, "phimoe", {"num_experts": "num_local_experts"})
    hidden, heads = f.size("hidden_size"), f.size("num_attention_heads")
    bias = f.bool("attention_bias")
    attention = common.mha(
        f,
        head_dim=common.head_dim(f, hidden, heads),
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=f.opt_size("sliding_window"),
    )
    num_experts, top_k = common.expert_counts(f, "num_local_experts")
    router = common.router(
        num_experts=num_experts, top_k=top_k, normalize=False, order="sparsemixer", jitter_eps=f.float("router_jitter_noise")
    )
    moe = MoESpec(router=router, expert=common.gated_mlp(hidden, f.size("intermediate_size"), common.activation(f)))
    # nn.LayerNorm(..., eps=config.rms_norm_eps) with weight and bias, despite the field's name.
    norm = NormSpec(kind="layer", eps=f.float("rms_norm_eps"), bias=True)
    layers = [LayerSpec(mixer=attention, ffn=moe, norm=norm)] * f.size("num_hidden_layers")
    extras = (("routing", "sparsemixer"), ("router_jitter_noise", f.float("router_jitter_noise")))
    return common.model_spec(
        f, name, "phimoe", layers, rope_spec(f, DEFAULT_THETA), norm, lm_head_bias=f.bool("lm_head_bias"), extras=extras
    )
