"""MLAttention against transformers' own DeepseekV3Attention, module against module.

Weights are copied from the reference module; outputs must agree for a full prompt, for prefill
followed by one-token decode steps through our latent cache, and for a left-padded row.
"""

from __future__ import annotations

import pytest
import torch

from moekit.model.attention import attention_mask
from moekit.model.mla import MLAttention
from moekit.model.rope import Rope
from moekit.spec.model_spec import AttentionSpec, RopeSpec
from moekit.spec.rope import yarn_softmax_scale

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ref_mod  # noqa: E402

HIDDEN, HEADS, KV_RANK, NOPE, ROPE_DIM, V_DIM = 48, 4, 16, 8, 8, 12
MAX_POS = 64  # = original 16 × factor 4, the ratio YaRN assumes
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 16,  # prompts below run past it, into the interpolated band
    "beta_fast": 32,
    "beta_slow": 1,
}
VARIANTS = {
    "q_lora_yarn": dict(q_lora_rank=24, rope=YARN, interleave=True),
    "no_q_lora_yarn": dict(q_lora_rank=None, rope=YARN, interleave=True),
    # DeepSeek-V2-Lite's real setting: mscale = mscale_all_dim, so cos/sin carry no extra factor
    "yarn_mscale_pair": dict(q_lora_rank=24, rope={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}, interleave=True),
    "plain_rope_halves": dict(q_lora_rank=24, rope={"rope_type": "default", "rope_theta": 500.0}, interleave=False),
}


def reference_config(q_lora_rank, rope, interleave) -> "transformers.DeepseekV3Config":
    cfg = transformers.DeepseekV3Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE_DIM,
        v_head_dim=V_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters=dict(rope),
        rope_interleave=interleave,
        attention_bias=False,
    )
    cfg._attn_implementation = "eager"
    return cfg


def our_specs(q_lora_rank, rope) -> tuple[AttentionSpec, RopeSpec]:
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    rope_spec = RopeSpec(
        theta=rope["rope_theta"],
        scaling=None if scaling["rope_type"] == "default" else tuple(sorted(scaling.items())),
    )
    attn = AttentionSpec(
        kind="mla",
        hidden_size=HIDDEN,
        num_heads=HEADS,
        num_kv_heads=HEADS,
        head_dim=NOPE + ROPE_DIM,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE_DIM,
        v_head_dim=V_DIM,
        softmax_scale=yarn_softmax_scale(rope_spec, NOPE + ROPE_DIM),  # as the deepseek adapter sets it
    )
    return attn, rope_spec


def build_pair(variant: str, seed: int = 0):
    """(reference attention, its rotary embedding, our MLAttention with the same weights)."""
    params = VARIANTS[variant]
    cfg = reference_config(**params)
    torch.manual_seed(seed)
    ref = ref_mod.DeepseekV3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():  # norm weights of 1 would hide a norm applied in the wrong place
        for name, p in ref.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    rotary = ref_mod.DeepseekV3RotaryEmbedding(cfg)
    attn_spec, rope_spec = our_specs(params["q_lora_rank"], params["rope"])
    ours = MLAttention(attn_spec, Rope(rope_spec, ROPE_DIM, MAX_POS), interleaved=params["interleave"])
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), rotary, ours.eval()


def causal_additive(t: int, past: int = 0) -> torch.Tensor:
    """The eager reference's float mask [1, 1, T, past+T]."""
    allowed = torch.ones(t, past + t, dtype=torch.bool).tril(past)
    return torch.zeros(t, past + t).masked_fill(~allowed, float("-inf"))[None, None]


def run_reference(ref, rotary, x, positions, cache=None, past=0):
    mask = causal_additive(x.shape[1], past) if x.shape[1] > 1 else None
    out, _ = ref(x, position_embeddings=rotary(x, positions), attention_mask=mask, cache=cache)
    return out


def run_ours(ours, x, positions, cache=None, start=0, key_mask=None):
    b, t, _ = x.shape
    if cache is None:
        cache = ours.new_cache(b, start + t, x.dtype, x.device)
    if key_mask is None:
        key_mask = torch.ones(b, cache.slots.shape[1], dtype=torch.bool)
    return ours(x, positions, cache, start, key_mask)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_full_prompt_matches_transformers(variant):
    ref, rotary, ours = build_pair(variant)
    torch.manual_seed(1)
    x = torch.randn(2, 21, HIDDEN)
    positions = torch.arange(21).expand(2, -1)
    expected = run_reference(ref, rotary, x, positions)
    torch.testing.assert_close(run_ours(ours, x, positions), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_prefill_then_decode_through_latent_cache(variant):
    ref, rotary, ours = build_pair(variant)
    torch.manual_seed(2)
    prompt, steps = 13, 6  # 13 + 6 crosses original_max_position_embeddings = 16
    x = torch.randn(2, prompt + steps, HIDDEN)
    positions = torch.arange(prompt + steps).expand(2, -1)
    ref_cache = DynamicCache(config=ref.config)
    ours_cache = ours.new_cache(2, prompt + steps, x.dtype, x.device)
    key_mask = torch.ones(2, prompt + steps, dtype=torch.bool)

    expected = run_reference(ref, rotary, x[:, :prompt], positions[:, :prompt], ref_cache)
    got = ours(x[:, :prompt], positions[:, :prompt], ours_cache, 0, key_mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    for i in range(prompt, prompt + steps):
        step = slice(i, i + 1)
        expected = run_reference(ref, rotary, x[:, step], positions[:, step], ref_cache, past=i)
        got = ours(x[:, step], positions[:, step], ours_cache, i, key_mask)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=f"decode step at slot {i}")


@torch.no_grad()
def test_left_padded_row_matches_unpadded():
    ref, rotary, ours = build_pair("q_lora_yarn")
    torch.manual_seed(3)
    pad, real, steps = 4, 9, 3
    x = torch.randn(1, real + steps, HIDDEN)
    alone = run_reference(ref, rotary, x, torch.arange(real + steps)[None])

    # row 0 is left-padded by `pad` slots; row 1 is a full-length neighbour that must not matter
    width = pad + real + steps
    batch_x = torch.cat((torch.randn(1, pad, HIDDEN), x), dim=1)
    batch_x = torch.cat((batch_x, torch.randn(1, width, HIDDEN)))
    key_mask = torch.ones(2, width, dtype=torch.bool)
    key_mask[0, :pad] = False
    positions = torch.stack((torch.cat((torch.zeros(pad, dtype=torch.long), torch.arange(real + steps))), torch.arange(width)))
    cache = ours.new_cache(2, width, x.dtype, x.device)
    outs = [ours(batch_x[:, : pad + real], positions[:, : pad + real], cache, 0, key_mask)]
    for i in range(pad + real, width):
        outs.append(ours(batch_x[:, i : i + 1], positions[:, i : i + 1], cache, i, key_mask))
    got = torch.cat(outs, dim=1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[0:1, pad:], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", ["q_lora_yarn", "no_q_lora_yarn"])
@pytest.mark.parametrize("new_tokens", [1, 5])
@torch.no_grad()
def test_absorbed_attention_equals_expanded(variant, new_tokens):
    """The decode fast path (kv_b folded into q and out) against the reference's expansion."""
    _, _, ours = build_pair(variant, seed=4)
    torch.manual_seed(5)
    b, s = 2, 11
    q_nope, q_rope = torch.randn(b, HEADS, new_tokens, NOPE), torch.randn(b, HEADS, new_tokens, ROPE_DIM)
    slots = torch.randn(b, s, KV_RANK + ROPE_DIM)  # latent then rope key, as the cache lays them out
    key_mask = torch.ones(b, s, dtype=torch.bool)
    key_mask[1, :3] = False
    mask = attention_mask(key_mask, s - new_tokens, new_tokens, window=None)
    expanded = ours.attend_expanded(q_nope, q_rope, slots, mask)
    absorbed = ours.attend_absorbed(q_nope, q_rope, slots, mask)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["q_lora_yarn", "no_q_lora_yarn"])
@torch.no_grad()
def test_prepare_fuses_and_splits_projections_without_changing_outputs(variant):
    _, _, plain = build_pair(variant, seed=6)
    _, _, fused = build_pair(variant, seed=6)
    fused.prepare()
    assert fused.x_proj is not None and fused.kv_a_proj_with_mqa is None
    assert fused.kv_b_proj is None and fused.w_uk.is_contiguous() and fused.w_uv_t.is_contiguous()
    n_params = sum(p.numel() for p in plain.parameters())
    assert sum(p.numel() for p in fused.parameters()) == n_params  # the parts are gone, not kept
    torch.manual_seed(7)
    x = torch.randn(2, 9, HIDDEN)
    positions = torch.arange(9).expand(2, -1)
    (want, want_cache), (got, got_cache) = (_prefill_then_decode(m, x, positions, prefill=6) for m in (plain, fused))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_cache.slots, want_cache.slots, atol=1e-6, rtol=0)


def _prefill_then_decode(mla, x, positions, prefill):
    """x [B, T, D]: `prefill` tokens at once, then one at a time → ([B, T, D], the cache)."""
    b, t, _ = x.shape
    cache = mla.new_cache(b, t, x.dtype, x.device)
    key_mask = torch.ones(b, t, dtype=torch.bool)
    out = [mla(x[:, :prefill], positions[:, :prefill], cache, 0, key_mask)]
    out += [mla(x[:, i : i + 1], positions[:, i : i + 1], cache, i, key_mask) for i in range(prefill, t)]
    return torch.cat(out, dim=1), cache


def test_cache_holds_latent_and_rope_key_only():
    """The point of MLA: a slot costs kv_lora_rank + qk_rope_head_dim numbers, not 2·H·head_dim."""
    _, _, ours = build_pair("q_lora_yarn")
    cache = ours.new_cache(3, 40, torch.float32, "cpu")
    per_slot = cache.slots.numel() // (3 * 40)
    assert per_slot == KV_RANK + ROPE_DIM
    assert per_slot < 2 * HEADS * (NOPE + ROPE_DIM)


@torch.no_grad()
def test_decode_does_not_reallocate_cache():
    _, _, ours = build_pair("q_lora_yarn")
    cache = ours.new_cache(1, 8, torch.float32, "cpu")
    storage = cache.slots.data_ptr()
    key_mask = torch.ones(1, 8, dtype=torch.bool)
    ours(torch.randn(1, 5, HIDDEN), torch.arange(5)[None], cache, 0, key_mask)
    ours(torch.randn(1, 1, HIDDEN), torch.tensor([[5]]), cache, 5, key_mask)
    assert cache.slots.data_ptr() == storage
    assert cache.latent[0, :6].abs().sum(-1).gt(0).all() and cache.latent[0, 6:].eq(0).all()
