"""KV cache sizes for each kind of mixer, against counts done by hand from the tiny configs."""

from tiny_configs import TINY_JAMBA, TINY_MIXTRAL, TINY_MLA, TINY_SLIDING, spec

from moekit.calc.dtypes import DTYPES
from moekit.calc.kv_cache import kv_cache

BF16 = DTYPES["bf16"]


def test_gqa_caches_k_and_v_for_each_kv_head():
    kv = kv_cache(spec(TINY_MIXTRAL), BF16, context=100, batch=3)
    # 3 layers × 2 (K, V) × 2 kv heads × head_dim 16 = 192 values, 2 bytes each.
    assert kv.bytes_per_token == 192 * 2
    assert kv.bytes_per_sequence == 192 * 100 * 2
    assert kv.total_bytes == 192 * 100 * 2 * 3


def test_mla_caches_the_latent_not_k_and_v():
    kv = kv_cache(spec(TINY_MLA), BF16, context=50, batch=1)
    # 2 layers × (kv_lora_rank 32 + rope 8); full K and V would be 2 × 4 heads × (16 + 8 | 16).
    assert kv.bytes_per_token == 2 * (32 + 8) * 2
    assert kv.bytes_per_sequence == 2 * 40 * 50 * 2


def test_sliding_window_layers_stop_growing_at_the_window():
    s = spec(TINY_SLIDING)
    per_layer = 2 * 2 * 16  # values per token in one layer
    long = kv_cache(s, BF16, context=100, batch=1)
    assert long.bytes_per_sequence == per_layer * (8 + 100 + 8) * 2
    short = kv_cache(s, BF16, context=5, batch=1)  # inside the window: nothing is capped
    assert short.bytes_per_sequence == per_layer * 5 * 3 * 2
    assert long.bytes_per_token == short.bytes_per_token == 3 * per_layer * 2


def test_mamba_state_does_not_grow_with_context():
    s = spec(TINY_JAMBA)
    state = 3 * 128 * (4 + 8)  # 3 mamba layers × d_inner × (d_conv + d_state)
    attention = 2 * 2 * 16  # one attention layer, 2 kv heads of 16
    for context in (10, 1000):
        kv = kv_cache(s, BF16, context=context, batch=2)
        assert kv.state_bytes_per_sequence == state * 2
        assert kv.attention_bytes_per_sequence == attention * context * 2
        assert kv.total_bytes == 2 * (state + attention * context) * 2


def test_fp8_cache_is_half_of_bf16():
    s = spec(TINY_MIXTRAL)
    assert 2 * kv_cache(s, DTYPES["fp8"], 64, 1).total_bytes == kv_cache(s, BF16, 64, 1).total_bytes
