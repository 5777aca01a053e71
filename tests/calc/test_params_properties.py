"""Properties every count must have, over random configs, and the figures vendors publish."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from moekit.calc.params import count_params, layer_params
from moekit.spec import load_spec, spec_from_config

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "gpt_oss", "deepseek_v3", "jamba", "phimoe")


@st.composite
def moe_configs(draw: st.DrawFn) -> dict:
    """A small random MoE config of any family, with K left for the test to set."""
    family = draw(st.sampled_from(FAMILIES))
    heads = draw(st.sampled_from([2, 4]))
    layers = draw(st.integers(1, 6))
    config = {
        "model_type": family,
        "vocab_size": draw(st.integers(5, 300)),
        "hidden_size": heads * draw(st.sampled_from([4, 8])),
        "intermediate_size": draw(st.integers(1, 64)),
        "moe_intermediate_size": draw(st.integers(1, 64)),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([1, heads])),
        "tie_word_embeddings": draw(st.booleans()),
    }
    experts = draw(st.integers(2, 12))
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        config[key] = experts
    if family in ("qwen3_moe", "qwen2_moe"):
        config["decoder_sparse_step"] = draw(st.integers(1, 3))
        config["mlp_only_layers"] = draw(st.lists(st.integers(0, layers - 1), max_size=2))
        config["shared_expert_intermediate_size"] = draw(st.integers(0, 32))
    if family == "deepseek_v3":
        config.update(
            q_lora_rank=draw(st.sampled_from([None, 8])), kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
            v_head_dim=4, n_group=1, topk_group=1, n_shared_experts=draw(st.integers(0, 2)),
            first_k_dense_replace=draw(st.integers(0, layers)),
        )  # fmt: skip
    if family == "gpt_oss":
        config["head_dim"] = 4
    if family == "jamba":
        config.update(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0)
    return config


def counts_at(config: dict, top_k: int):
    return count_params(spec_from_config({**config, "num_experts_per_tok": top_k}, "prop"))


def experts_of(config: dict) -> int:
    return config["num_experts"]


@settings(max_examples=60, deadline=None)
@given(moe_configs(), st.data())
def test_active_never_exceeds_total_and_conventions_nest(config: dict, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, experts_of(config)))
    c = counts_at(config, k)
    assert 0 < c.active_params <= c.total_params
    assert c.active_params_non_embedding <= c.active_params_excl_input_embedding <= c.active_params
    assert 0 < c.active_fraction <= 1


@settings(max_examples=60, deadline=None)
@given(moe_configs())
def test_active_grows_with_k_and_reaches_total_at_k_equal_e(config: dict) -> None:
    experts = experts_of(config)
    actives = [counts_at(config, k).active_params for k in range(1, experts + 1)]
    assert actives == sorted(actives)
    full = counts_at(config, experts)
    assert full.active_params == full.total_params


@settings(max_examples=40, deadline=None)
@given(moe_configs())
def test_layers_add_up_to_the_total(config: dict) -> None:
    spec = spec_from_config({**config, "num_experts_per_tok": 1}, "prop")
    counts = count_params(spec)
    b = counts.breakdown
    per_layer = sum(layer_params(layer).total for layer in spec.layers)
    final_norm = spec.final_norm.params(spec.hidden_size)
    assert per_layer + b.embedding + b.head + final_norm == counts.total_params


def published(n: int, figure: float) -> bool:
    """Whether a vendor's one-decimal figure (in billions) is n rounded or truncated."""
    billions = n / 1e9
    return figure in (round(billions, 1), math.floor(billions * 10) / 10)


def test_mixtral_8x7b_published_figures() -> None:
    c = count_params(load_spec("mixtral-8x7b"))
    assert published(c.total_params, 46.7) and published(c.active_params, 12.9)


def test_qwen3_30b_a3b_published_figures() -> None:
    c = count_params(load_spec("qwen3-30b-a3b"))
    assert published(c.total_params, 30.5) and published(c.active_params, 3.3)


def test_deepseek_v3_published_figures() -> None:
    c = count_params(load_spec("deepseek-v3"))
    assert round(c.total_params / 1e9) == 671
    # "+14B multi-token-prediction module = 685B on the Hub": ours is 13.5B, 684.5B together
    assert abs(c.breakdown.mtp / 1e9 - 14) < 1
    assert abs((c.total_params + c.breakdown.mtp) / 1e9 - 685) < 1
    # "36.6B including 0.9B for the output head" → the 37B headline, input embedding excluded
    assert published(c.active_params_excl_input_embedding, 36.6)
    assert published(c.breakdown.head, 0.9)
    assert round(c.active_params_excl_input_embedding / 1e9) == 37
