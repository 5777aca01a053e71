"""gpt_oss: biased router, top-K on logits then softmax over the K; clamped SwiGLU experts with
biases; attention sinks; sliding and full layers alternating by `layer_types`; YaRN by default."""

from __future__ import annotations

from moekit.spec.adapters import common
from moekit.spec.model_spec import LayerSpec, MLPSpec, ModelSpec, MoESpec
from moekit.spec.rope import rope_spec

DEFAULTS = {
    "num_local_experts": 128,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "bos_token_id": None,
    "eos_token_id": None,
    "attention_bias": True,
}
DEFAULT_THETA = 150000.0
# GptOssConfig's rope when config.json names none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def build(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, DEFAULTS, "gpt_oss", {"num_experts": "num_local_experts"})
    hidden, heads, num_layers = f.size("hidden_size"), f.size("num_attention_heads"), f.size("num_hidden_layers")
    head_dim = common.head_dim(f, hidden, heads)
    bias = f.bool("attention_bias")
    default_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    windows = common.layer_windows(f, num_layers, default_types, f.opt_size("sliding_window"))
    num_experts, top_k = common.expert_counts(f, "num_local_experts")
    # Router logits and their softmax stay in the model dtype (no fp32 upcast in GptOssTopKRouter).
    router = common.router(
        num_experts=num_experts, top_k=top_k, order="topk_then_score", normalize=False, bias=True
    )
    width = f.size("intermediate_size")
    expert = MLPSpec(hidden_size=hidden, width=width, gated=True, bias=True, activation="swiglu_oai")
    moe = MoESpec(router=router, expert=expert)
    norm = common.rms_norm(f)
    layers = [
        LayerSpec(
            mixer=common.mha(f, head_dim=head_dim, qkv_bias=bias, o_bias=bias, sinks=True, sliding_window=w),
            ffn=moe,
            norm=norm,
        )
        for w in windows
    ]
    extras = (("swiglu_limit", f.float("swiglu_limit")), ("swiglu_alpha", f.float("swiglu_alpha")))
    rope = rope_spec(f, DEFAULT_THETA, DEFAULT_ROPE)
    return common.model_spec(f, name, "gpt_oss", layers, rope, norm, extras=extras)
