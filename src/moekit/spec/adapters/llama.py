"""Dense llama and mistral: no experts; the baselines the MoE share is measured against."""

from __future__ import annotations

from moekit.spec.adapters import common
from moekit.spec.model_spec import LayerSpec, ModelSpec
from moekit.spec.rope import rope_spec

LLAMA_DEFAULTS = {
    "intermediate_size": 11008,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "head_dim": None,
}
MISTRAL_DEFAULTS = {
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "sliding_window": 4096,
}
DEFAULT_THETA = 10000.0


def build_llama(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, LLAMA_DEFAULTS, "llama")
    hidden, heads = f.size("hidden_size"), f.size("num_attention_heads")
    bias = f.bool("attention_bias")
    attention = common.mha(f, head_dim=common.head_dim(f, hidden, heads), qkv_bias=bias, o_bias=bias)
    mlp = common.gated_mlp(hidden, f.size("intermediate_size"), common.activation(f), bias=f.bool("mlp_bias"))
    norm = common.rms_norm(f)
    layers = [LayerSpec(mixer=attention, ffn=mlp, norm=norm)] * f.size("num_hidden_layers")
    return common.model_spec(f, name, "llama", layers, rope_spec(f, DEFAULT_THETA), norm)


def build_mistral(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, MISTRAL_DEFAULTS, "mistral")
    hidden, heads = f.size("hidden_size"), f.size("num_attention_heads")
    # config.sliding_window (default 4096) reaches the mask and the kernel of every layer.
    attention = common.mha(
        f, head_dim=common.head_dim(f, hidden, heads), sliding_window=f.opt_size("sliding_window")
    )
    mlp = common.gated_mlp(hidden, f.size("intermediate_size"), common.activation(f))
    norm = common.rms_norm(f)
    layers = [LayerSpec(mixer=attention, ffn=mlp, norm=norm)] * f.size("num_hidden_layers")
    return common.model_spec(f, name, "mistral", layers, rope_spec(f, DEFAULT_THETA), norm)
