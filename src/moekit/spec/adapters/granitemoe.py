"""granitemoe: top-K on fp32 router logits, softmax over the K; four scalar multipliers."""

from __future__ import annotations

from moekit.spec.adapters import common
from moekit.spec.model_spec import LayerSpec, ModelSpec, MoESpec, Multipliers
from moekit.spec.rope import rope_spec

DEFAULTS = {
    "intermediate_size": 11008,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "embedding_multiplier": 1.0,
    "logits_scaling": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": 1.0,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
DEFAULT_THETA = 10000.0


def build(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, DEFAULTS, "granitemoe")
    hidden, heads = f.size("hidden_size"), f.size("num_attention_heads")
    bias = f.bool("attention_bias")
    # attention_multiplier IS the softmax scale (it replaces 1/sqrt(head_dim), default 1.0).
    attention = common.mha(
        f,
        head_dim=common.head_dim(f, hidden, heads),
        qkv_bias=bias,
        o_bias=bias,
        softmax_scale=f.float("attention_multiplier"),
    )
    num_experts, top_k = common.expert_counts(f, "num_local_experts")
    # The softmax over the K chosen logits already sums to one: no renormalisation.
    router = common.router(num_experts=num_experts, top_k=top_k, order="topk_then_score", normalize=False)
    moe = MoESpec(router=router, expert=common.gated_mlp(hidden, f.size("intermediate_size"), common.activation(f)))
    norm = common.rms_norm(f)
    layers = [LayerSpec(mixer=attention, ffn=moe, norm=norm)] * f.size("num_hidden_layers")
    multipliers = Multipliers(
        embedding=f.float("embedding_multiplier"),
        residual=f.float("residual_multiplier"),
        logits_scaling=f.float("logits_scaling"),
    )
    return common.model_spec(
        f, name, "granitemoe", layers, rope_spec(f, DEFAULT_THETA), norm, multipliers=multipliers
    )
