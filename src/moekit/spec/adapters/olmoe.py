"""olmoe: every layer MoE; q/k RMSNorm over the whole projection; optional clip_qkv."""

from __future__ import annotations

from moekit.spec.adapters import common
from moekit.spec.model_spec import LayerSpec, ModelSpec, MoESpec
from moekit.spec.rope import rope_spec

DEFAULTS = {
    "intermediate_size": 2048,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "bos_token_id": None,
    "eos_token_id": 50279,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "clip_qkv": None,
    "num_experts_per_tok": 8,
    "num_experts": 64,
    "norm_topk_prob": False,
}
DEFAULT_THETA = 10000.0


def build(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, DEFAULTS, "olmoe", {"num_local_experts": "num_experts"})
    hidden, heads = f.size("hidden_size"), f.size("num_attention_heads")
    bias = f.bool("attention_bias")
    # q_norm spans hidden_size and k_norm (hidden // heads) × kv_heads: the "full" q/k norm.
    attention = common.mha(f, head_dim=common.head_dim(f, hidden, heads), qkv_bias=bias, o_bias=bias, qk_norm="full")
    num_experts, top_k = common.expert_counts(f, "num_experts")
    moe = MoESpec(
        router=common.router(num_experts=num_experts, top_k=top_k, normalize=f.bool("norm_topk_prob")),
        expert=common.gated_mlp(hidden, f.size("intermediate_size"), common.activation(f)),
    )
    norm = common.rms_norm(f)
    layers = [LayerSpec(mixer=attention, ffn=moe, norm=norm)] * f.size("num_hidden_layers")
    clip = f.opt_float("clip_qkv")
    extras = (("clip_qkv", clip),) if clip is not None else ()
    return common.model_spec(f, name, "olmoe", layers, rope_spec(f, DEFAULT_THETA), norm, extras=extras)
