"""A tiny config every family's adapter tests start from (sizes only; each test adds model_type)."""

TINY = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
