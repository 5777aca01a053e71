from tiny_configs import TINY_MIXTRAL, spec

from moekit.calc.dtypes import DTYPES
from moekit.calc.memory import memory_plan
from moekit.calc.params import count_params
from moekit.spec import load_spec


def plan(config_or_spec, dtype="bf16", context=100, batch=3):
    s = spec(config_or_spec) if isinstance(config_or_spec, dict) else config_or_spec
    return memory_plan(s, count_params(s), DTYPES[dtype], DTYPES["bf16"], context, batch)


def test_weights_split_into_resident_and_routed_experts():
    # Routed: 3 layers × 4 experts × 3 × 64 × 32. Resident: attention 3 × (64·64·2 + 64·32·2),
    # routers 3 × 64 × 4, norms 3 × 2 × 64 + 64, embedding and head 2 × 100 × 64.
    routed = 3 * 4 * 3 * 64 * 32
    resident = 3 * (2 * 64 * 64 + 2 * 64 * 32) + 3 * 64 * 4 + (3 * 2 * 64 + 64) + 2 * 100 * 64
    w = plan(TINY_MIXTRAL).weights
    assert (w.resident, w.routed_experts, w.total) == (2 * resident, 2 * routed, 2 * (resident + routed))


def test_quantised_weight_bytes_include_block_scales():
    routed = 3 * 4 * 3 * 64 * 32  # a multiple of 128: whole groups and blocks
    assert plan(TINY_MIXTRAL, "int4").weights.routed_experts == routed // 128 * (128 * 4 + 16) // 8
    assert plan(TINY_MIXTRAL, "mxfp4").weights.routed_experts == routed // 32 * (32 * 4 + 8) // 8


def test_activation_workspace_estimate():
    # Per token: (4 × D + K × 2F) × 2 B + (heads × context + V) × 4 B.
    per_token = (4 * 64 + 2 * 2 * 32) * 2 + (4 * 100 + 100) * 4
    assert plan(TINY_MIXTRAL, context=100, batch=3).activations == 3 * per_token


def test_total_adds_weights_cache_and_activations():
    m = plan(TINY_MIXTRAL)
    assert m.total == m.weights.total + m.kv.total_bytes + m.activations


def test_mtp_module_is_reported_apart():
    s = load_spec("deepseek-v3")
    counts = count_params(s)
    w = memory_plan(s, counts, DTYPES["fp8"], DTYPES["bf16"], 1, 1).weights
    assert w.mtp == counts.breakdown.mtp > 0
    assert w.total == counts.total_params  # fp8: one byte each, MTP not included


def test_mxfp4_prices_only_the_routed_experts_at_4_25_bits():
    # gpt-oss ships MXFP4 experts and bf16 everything else: the resident weights stay at 2 bytes.
    resident = 3 * (2 * 64 * 64 + 2 * 64 * 32) + 3 * 64 * 4 + (3 * 2 * 64 + 64) + 2 * 100 * 64
    w = plan(TINY_MIXTRAL, "mxfp4").weights
    assert w.resident == 2 * resident == plan(TINY_MIXTRAL, "bf16").weights.resident
    assert w.total == w.resident + w.routed_experts
