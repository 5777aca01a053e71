"""mixtral: every layer a softmax top-K MoE, weights renormalised over the K (always)."""

from __future__ import annotations

from moekit.spec.adapters import common
from moekit.spec.model_spec import LayerSpec, ModelSpec, MoESpec
from moekit.spec.rope import rope_spec

# MixtralConfig's defaults (transformers 5.24); required fields have none.
DEFAULTS = {
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "num_experts_per_tok": 2,
    "num_local_experts": 8,
}
DEFAULT_THETA = 1e6


def build(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, DEFAULTS, "mixtral", {"num_experts": "num_local_experts"})
    hidden, heads = f.size("hidden_size"), f.size("num_attention_heads")
    num_experts, top_k = common.expert_counts(f, "num_local_experts")
    # The mask and the attention kernel both take config.sliding_window, for every layer.
    attention = common.mha(
        f, head_dim=common.head_dim(f, hidden, heads), sliding_window=f.opt_size("sliding_window")
    )
    moe = MoESpec(
        router=common.router(num_experts=num_experts, top_k=top_k, normalize=True),
        expert=common.gated_mlp(hidden, f.size("intermediate_size"), common.activation(f)),
    )
    norm = common.rms_norm(f)
    layers = [LayerSpec(mixer=attention, ffn=moe, norm=norm)] * f.size("num_hidden_layers")
    return common.model_spec(f, name, "mixtral", layers, rope_spec(f, DEFAULT_THETA), norm)
