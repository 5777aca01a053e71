"""phimoe (Phi-3.5-MoE): sparsemixer routing, LayerNorms with bias, attention and head biases,
longrope — greedy generation token for token and logits equal to transformers' on tiny
checkpoints written by its save_pretrained."""

from __future__ import annotations


import pytest
import torch


from hf_tiny import assert_engine_matches_reference, build_reference
from moekit.engine.loader import load_engine
from moekit.errors import SpecError
from moekit.model.routing import route
from moekit.spec.model_spec import RouterSpec

PROMPT = [1, 17, 42, 99, 5, 63, 120]
HEAD_DIM = 12  # hidden 48 / 4 heads
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
    "long_factor": [2.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
    "short_mscale": 1.2,
    "long_mscale": 1.2,
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "biases": {},
    "no-biases-tied": {"attention_bias": False, "lm_head_bias": False, "tie_word_embeddings": True},
    "tied-head-bias": {"tie_word_embeddings": True},
    "longrope": {"rope_scaling": {**LONGROPE, "rope_theta": 10000.0}},
    "window": {"sliding_window": 6},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_phimoe_generates_what_transformers_generates(variant, tmp_path):
    assert_engine_matches_reference("phimoe", tmp_path, PROMPT, seed=4, **VARIANTS[variant])


def test_sparsemixer_equals_the_reference_function():
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=gen) * 2
    logits[:8, 1] = logits[:8, 0] + 1e-3  # near ties: inside the jitter band
    want_weights, want_ids = sparsemixer(logits, jitter_eps=0.01, training=False, top_k=2)
    got = route(logits, RouterSpec(num_experts=8, top_k=2, normalize=False, order="sparsemixer", jitter_eps=0.01))
    assert torch.equal(got.topk_ids, want_ids)
    assert torch.equal(got.topk_weights, want_weights)


def test_longrope_with_two_mscales_is_refused_not_approximated(tmp_path):
    scaling = {**LONGROPE, "long_mscale": 1.5, "rope_theta": 10000.0}
    build_reference("phimoe", seed=4, rope_scaling=scaling).save_pretrained(tmp_path)
    with pytest.raises(SpecError, match="short_mscale 1.2 != long_mscale 1.5"):
        load_engine(tmp_path, compile=False)
