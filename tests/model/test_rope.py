"""Rotary tables equal transformers' for every supported rope_type, YaRN's attention factor included."""

from __future__ import annotations

import pytest
import torch

from moekit.errors import SpecError
from moekit.model.rope import Rope, apply_rope, apply_rope_interleaved, apply_rope_rolled, inverse_frequencies
from moekit.spec.model_spec import RopeSpec

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HEAD_DIM, MAX_POS = 32, 512

PARAMS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn-gpt-oss": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    "yarn-deepseek": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 64},
    "yarn-mscale-ratio": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 128},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
}


def _config(params: dict):
    return transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS, rope_parameters=dict(params),
    )


def _spec(params: dict) -> RopeSpec:
    rest = tuple(sorted((k, v) for k, v in params.items() if k != "rope_theta"))
    return RopeSpec(theta=params["rope_theta"], scaling=None if params["rope_type"] == "default" else rest)


def _reference(params: dict) -> tuple[torch.Tensor, float]:
    config = _config(params)
    if params["rope_type"] == "default":
        return transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config)


@pytest.mark.parametrize("key", sorted(PARAMS))
def test_inverse_frequencies_and_attention_factor_match_transformers(key):
    params = PARAMS[key]
    want_inv, want_factor = _reference(params)
    got_inv, got_factor = inverse_frequencies(_spec(params), HEAD_DIM, MAX_POS)
    assert torch.equal(got_inv, want_inv.float())
    assert got_factor == pytest.approx(want_factor, rel=1e-12)


@pytest.mark.parametrize("key", ["default", "yarn-deepseek", "llama3"])
def test_cos_sin_tables_match_transformers(key):
    config = _config(PARAMS[key])
    reference = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 5, 77, 300, 511]])
    want_cos, want_sin = reference(torch.zeros(1, dtype=torch.float32), positions)
    rope = Rope(_spec(PARAMS[key]), HEAD_DIM, MAX_POS)
    rope.reserve(MAX_POS)
    cos, sin = rope.cos_sin(positions, torch.float32)
    assert (cos - want_cos).abs().max().item() < 1e-6
    assert (sin - want_sin).abs().max().item() < 1e-6


def test_tables_grow_on_demand():
    rope = Rope(_spec(PARAMS["default"]), 8, MAX_POS)
    cos, _ = rope.cos_sin(torch.tensor([[40]]), torch.float32)
    assert rope.cos_table.shape[0] >= 41
    assert cos[0, 0, 0].item() == pytest.approx(torch.cos(torch.tensor(40.0)).item(), abs=1e-6)


def test_rotation_preserves_norm_and_position_zero_is_identity():
    rope = Rope(_spec(PARAMS["default"]), 8, MAX_POS)
    x = torch.randn(1, 2, 3, 8)
    cos, sin = rope.cos_sin(torch.tensor([[0, 3, 9]]), torch.float32)
    for apply in (apply_rope, apply_rope_interleaved):
        y = apply(x, cos, sin)
        assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.equal(apply_rope(x, cos, sin)[:, :, 0], x[:, :, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rolled_rope_is_bit_for_bit_rotate_half(dtype):
    """The fast form ([B, T, heads, rot], the sign folded into sin) against apply_rope ([B, H, T, rot])."""
    rope = Rope(_spec(PARAMS["yarn-deepseek"]), 16, MAX_POS)
    positions = torch.tensor([[0, 3, 9, 200], [1, 2, 3, 4]])
    x = torch.randn(2, 4, 5, 16).to(dtype)  # [B, T, heads, rot]
    cos, sin = rope.cos_sin(positions, dtype)
    want = apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)
    got = apply_rope_rolled(x, *rope.cos_sin_signed(positions, dtype))
    assert torch.equal(got, want)


def test_interleaved_rope_is_rolled_rope_on_deinterleaved_pairs():
    """MLA de-interleaves (x0, x1), (x2, x3).. and rotates half-and-half; the reference rotates the pairs."""
    rope = Rope(_spec(PARAMS["default"]), 8, MAX_POS)
    positions = torch.tensor([[0, 5, 17]])
    x = torch.randn(1, 3, 2, 8)  # [B, T, heads, rot]
    cos, sin = rope.cos_sin(positions, torch.float32)
    want = apply_rope_interleaved(x.transpose(1, 2), cos, sin).transpose(1, 2)
    pairs_split = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    assert torch.equal(apply_rope_rolled(pairs_split, *rope.cos_sin_signed(positions, torch.float32)), want)


def test_unknown_rope_type_is_a_spec_error():
    with pytest.raises(SpecError, match="rope_type 'dynamic' is not supported"):
        inverse_frequencies(RopeSpec(scaling=(("rope_type", "dynamic"),)), 8, 64)
    with pytest.raises(SpecError, match="longrope needs short_factor and original_max_position_embeddings"):
        inverse_frequencies(RopeSpec(scaling=(("rope_type", "longrope"),)), 8, 64)
