"""The activation meter: per-token parameters equal a hand count from the config; the experts it
reports are the ones transformers chooses; dense models touch everything."""

from __future__ import annotations

import pytest

from hf_tiny import build_reference, reference_routing, tiny_config
from moekit.engine.loader import load_engine

transformers = pytest.importorskip("transformers")


def hand_count_mixtral() -> tuple[int, int, int]:
    """(params touched per token, active params, total params), counted from the config by hand."""
    c = tiny_config("mixtral")
    d, heads, kv, f = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    e, k, layers, vocab = c.num_local_experts, c.num_experts_per_tok, c.num_hidden_layers, c.vocab_size
    hd = d // heads
    attention = d * heads * hd + 2 * d * kv * hd + heads * hd * d  # q, k, v, o
    per_layer = attention + 2 * d + e * d + k * 3 * d * f  # + 2 norms, router, K experts (w1 w2 w3)
    touched = layers * per_layer + d + vocab * d + d  # final norm, head, ONE embedding row
    active = touched - d + vocab * d  # the embedding table in full
    total = sum(p.numel() for p in build_reference("mixtral").parameters())
    return touched, active, total


def test_params_per_token_equal_a_hand_count(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("mixtral"), compile=False)
    gen = engine.generate([1, 17, 42, 99], max_new_tokens=6, stop_ids=())
    acts = engine.meter(gen)
    touched, active, total = hand_count_mixtral()
    assert len(acts) == 6
    for a in acts:
        assert a.params_touched == touched
        assert a.active_params == active
        assert a.bytes_touched == 4 * touched  # fp32
        assert a.share == pytest.approx(active / total)
        assert 0 < a.share < 1
        assert all(len(ids) == 2 for ids in a.experts.values())
        assert sorted(a.experts) == [0, 1]


def test_a_dense_model_touches_all_of_itself(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("llama"), compile=False)
    acts = engine.meter(engine.generate([1, 17, 42], max_new_tokens=4, stop_ids=()))
    assert len(acts) == 4
    assert all(a.share == 1.0 and a.experts == {} for a in acts)


def test_bytes_follow_the_engine_dtype(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), dtype="bfloat16", compile=False)
    acts = engine.meter(engine.generate([1, 17, 42], max_new_tokens=3, stop_ids=()))
    assert all(a.bytes_touched == 2 * a.params_touched for a in acts)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_metered_experts_are_the_ones_transformers_chooses(family, tiny_checkpoints):
    folder = tiny_checkpoints(family)
    engine = load_engine(folder, compile=False)
    prompt = [1, 17, 42, 99, 5]
    gen = engine.generate(prompt, max_new_tokens=10, stop_ids=())
    acts = engine.meter(gen)
    # The pass that produced generated token i fed sequence position len(prompt) - 1 + i.
    sequence = prompt + gen.token_ids[0][:-1]
    theirs = reference_routing(build_reference(family), sequence)
    assert sorted(theirs) == sorted(acts[0].experts) == list(engine.spec.moe_layers)
    for a in acts:
        for layer, ids in a.experts.items():
            assert sorted(ids) == sorted(theirs[layer][a.position])


def test_distinct_experts_grow_and_stay_within_the_layer(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    acts = engine.meter(engine.generate([1, 17, 42, 99, 5, 6], max_new_tokens=12, stop_ids=()))
    totals = [a.distinct_experts_total for a in acts]
    assert totals == sorted(totals)
    for a in acts:
        assert all(2 <= n <= 8 for n in a.distinct_experts.values())
        assert a.distinct_experts_total == sum(a.distinct_experts.values())
        for layer, ids in a.experts.items():
            assert len(set(ids)) <= a.distinct_experts[layer]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss", "deepseek_v3", "llama"])
def test_a_token_using_k_experts_is_the_calculators_active_count(family, tiny_checkpoints):
    from moekit.calc.params import count_params
    from moekit.engine.meter import params_per_token

    spec = load_engine(tiny_checkpoints(family), compile=False).spec
    counts = params_per_token(spec)
    assert counts.active(counts.typical()) == count_params(spec).active_params
