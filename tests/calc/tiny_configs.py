"""Tiny configs small enough to count by hand, one per attention kind the calculator treats
differently (GQA, MLA, sliding window, mamba)."""

from __future__ import annotations

from moekit.spec import spec_from_config

# D 64, 4 heads of 16, 2 KV heads, 3 layers, E 4, K 2, F 32, V 100.
TINY_MIXTRAL = {
    "model_type": "mixtral",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
    "max_position_embeddings": 256,
}

# MLA: kv_lora_rank 32, rope 8: 40 cached values per layer per token; 1 dense + 1 MoE layer.
TINY_MLA = {
    "model_type": "deepseek_v3",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "num_nextn_predict_layers": 0,
}

# Sliding window 8 on layers 0 and 2, full attention on layer 1.
TINY_SLIDING = {
    "model_type": "gpt_oss",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
}

# Mamba everywhere but layer 1 (attention); MoE on odd layers.
TINY_JAMBA = {
    "model_type": "jamba",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "attn_layer_period": 4,
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "mamba_d_state": 8,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}


def spec(config: dict, name: str = "tiny"):
    return spec_from_config(dict(config), name)
