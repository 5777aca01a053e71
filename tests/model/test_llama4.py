"""llama4 text (Llama4ForCausalLM, and the text decoder of a Llama4ForConditionalGeneration
checkpoint): chunked attention, L2 q/k norm after a pair-wise complex RoPE, NoPE layers with
temperature-tuned queries, sigmoid top-K routing whose weight scales the expert's INPUT, a shared
expert, dense and MoE layers interleaved — greedy tokens and logits equal to transformers'.

The tiny config (hf_tiny.FAMILIES["llama4_text"]) attends in chunks of 5 over 27+ tokens, has a
NoPE layer whose query temperature changes every 4 positions, and K = 2 (Llama 4 itself routes one).
"""

from __future__ import annotations


import pytest
import torch


from hf_tiny import COMMON, FAMILIES, _spread_routers, assert_engine_matches_reference, build_reference
from moekit.engine.generate import left_pad
from moekit.engine.loader import load_engine
from moekit.model.experts import RoutedExperts, experts_reference
from moekit.model.mlp import Activation
from moekit.model.rope import Rope, apply_rope_complex, apply_rope_rolled, pairs_to_halves
from moekit.model.routing import RoutingDecision, route, route_rows
from moekit.offload.options import OffloadOptions
from moekit.spec.model_spec import MLPSpec, RopeSpec, RouterSpec

transformers = pytest.importorskip("transformers")

PROMPT = [1, 17, 42, 99, 5, 63, 120]
VARIANTS = {
    # Llama-4-Scout's shape: one expert per token, every layer MoE, llama3 rope scaling.
    "scout-like": dict(
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    # Llama-4-Maverick's: no q/k norm.
    "no qk norm, no tuning": dict(use_qk_norm=False, attn_temperature_tuning=False),
    "moe_layers listed, no chunks": dict(moe_layers=[0, 2], attention_chunk_size=None),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llama4_generates_what_transformers_generates(variant, tmp_path):
    assert_engine_matches_reference("llama4_text", tmp_path, PROMPT, seed=3, **VARIANTS[variant])


def test_pair_wise_rope_is_the_rolled_rope_on_reordered_dims():
    """transformers' complex rotation of (x0, x1), (x2, x3).. equals moekit's rolled rotation of the
    same dims reordered into halves (what the loader does to q/k rows), to the last fp32 bit or so."""
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

    hd, heads = 12, 3
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, heads, hd, generator=gen)
    positions = torch.tensor([list(range(9)), list(range(40, 49))])
    rope = Rope(RopeSpec(theta=500000.0, interleaved=True, fp32=True), hd, 64)
    freqs = positions[..., None].float() * rope.inv_freq
    theirs, _ = apply_rotary_emb(x, x, torch.polar(torch.ones_like(freqs), freqs))
    torch.testing.assert_close(apply_rope_complex(x, positions, rope.inv_freq), theirs, rtol=0, atol=0)
    perm = pairs_to_halves(torch.arange(hd), 1, hd)  # [0, 2, 4, .., 1, 3, 5, ..]
    rope.reserve(64)
    cos, sin_signed = rope.cos_sin_signed(positions, torch.float32)
    ours = apply_rope_rolled(x[..., perm], cos, sin_signed)
    torch.testing.assert_close(ours, theirs[..., perm], rtol=1e-6, atol=1e-6)


def test_sigmoid_top_k_routing_is_llama4s_router():
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    cfg = transformers.Llama4TextConfig(**{**COMMON, **FAMILIES["llama4_text"]})
    router = Llama4Router(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    x = torch.randn(11, cfg.hidden_size, generator=gen)
    spec = RouterSpec(num_experts=6, top_k=2, scoring="sigmoid", order="topk_then_score", normalize=False, fp32=False)
    with torch.no_grad():
        scores, logits = router(x)  # [T, E]: sigmoid of the chosen, 0 elsewhere
        for k in (2, 1):
            router.top_k = k
            want, _ = router(x)
            got = route(logits, spec) if k == 2 else route_rows(logits, spec, None, [1] * len(x))
            dense = torch.zeros_like(want).scatter_(1, got.topk_ids, got.topk_weights)
            torch.testing.assert_close(dense, want, rtol=0, atol=0)


@pytest.mark.parametrize("tokens,k", [(1, 1), (1, 2), (9, 2), (30, 3)])
def test_experts_weighing_their_input_equal_the_obvious_sum(tokens, k):
    gen = torch.Generator().manual_seed(tokens + k)
    ex = RoutedExperts(MLPSpec(hidden_size=16, width=12), 6, Activation())
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    ex.weigh_input = True
    x = torch.randn(tokens, 16, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:k] for _ in range(tokens)])
    decision = RoutingDecision(topk_ids=ids, topk_weights=torch.rand(tokens, k, generator=gen))
    want = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(k):
            want[t] += ex.expert(int(ids[t, j]), x[t : t + 1] * decision.topk_weights[t, j])[0]
    # One row at a time against an expert's rows in one GEMM: two fp32 summation orders, which
    # differ by a few ulps (3e-6 seen on an AVX-512 machine's GEMM, 30 rows).
    torch.testing.assert_close(ex(x, decision), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(experts_reference(ex, x, decision), want, rtol=1e-5, atol=1e-5)


def test_a_left_padded_batch_is_each_prompt_alone(tmp_path):
    """Padding changes nothing: chunks start at each row's first real token, and the NoPE layer's
    query temperature follows each token's position.

    transformers 5.24 is no oracle for the second part: its temperature counts cache slots
    (`past_seen_tokens + arange`), not positions, so a left-padded row's logits move (about 1e-2
    here) with its padding. Its chunk mask does start at the first real token; with the tuning
    off, its padded rows equal their lone runs. So the oracle for a padded row is transformers on
    that row alone, which is what the row means.
    """
    model = build_reference("llama4_text")
    model.save_pretrained(tmp_path)
    engine = load_engine(tmp_path, compile=False)
    prompts = [[1, 17, 42], [3, 9, 27, 81, 100, 4, 16, 64, 2], [7, 8, 9, 10, 11]]
    ids, mask, positions = left_pad(prompts, pad_id=0)
    width = ids.shape[1]
    with torch.inference_mode():
        cache = engine.decoder.new_cache(len(prompts), width)
        cache.key_mask[:] = mask
        ours = engine.decoder(ids, cache, positions)  # [B, P, V]
        theirs_padded = model(input_ids=ids, attention_mask=mask.long()).logits
        for i, prompt in enumerate(prompts):
            alone = model(input_ids=torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(ours[i, width - len(prompt) :], alone, rtol=1e-4, atol=1e-4)
        drift = max((theirs_padded[i, width - len(p) :] - model(input_ids=torch.tensor([p])).logits[0]).abs().max()
                    for i, p in enumerate(prompts))
    assert drift > 1e-3, "transformers' padded llama4 rows now equal their lone runs: drop the note above"
    batch = engine.generate(prompts, max_new_tokens=12, stop_ids=())
    assert batch.token_ids == [engine.generate(p, max_new_tokens=12, stop_ids=()).token_ids[0] for p in prompts]


def test_a_multimodal_checkpoint_runs_its_text_decoder(tmp_path):
    """model_type llama4 (Llama4ForConditionalGeneration): the text decoder under language_model.,
    the vision tower and projector left unread; tokens and logits equal transformers' on text.

    transformers 5.24's Llama4ForConditionalGeneration.forward cannot run text alone (it reads
    `image_outputs` off an output that has none: AttributeError), so the oracle is the model's own
    text decoder, its `language_model` (a Llama4ForCausalLM), with the weights the file holds."""
    text = {**COMMON, **FAMILIES["llama4_text"]}
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  vision_output_dim=32, image_size=28, patch_size=14, projector_input_dim=32,
                  projector_output_dim=32, pixel_shuffle_ratio=0.5)
    torch.manual_seed(5)
    model = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text, vision_config=vision))
    _spread_routers(model, 6)  # router logits apart, as for every tiny checkpoint
    model.eval().save_pretrained(tmp_path)
    engine = load_engine(tmp_path, compile=False)
    model = model.language_model
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                              pad_token_id=0, eos_token_id=None)
        want_logits = model(input_ids=ids).logits[0, -1]
        got_logits = engine.decoder(ids, engine.decoder.new_cache(1, len(PROMPT)), torch.arange(len(PROMPT))[None])[0, -1]
    assert engine.spec.vision_params > 0
    assert engine.generate([PROMPT], max_new_tokens=20, stop_ids=()).token_ids[0] == want[0, len(PROMPT) :].tolist()
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)


def test_paged_experts_generate_the_resident_tokens(tmp_path):
    """llama4's [E, D, 2F] / [E, F, D] stacks read one expert's slice each, transposed on read."""
    from moekit.weights.extents import expert_extents
    from moekit.offload.reader import ExpertReader

    build_reference("llama4_text").save_pretrained(tmp_path)
    prompts = [PROMPT, [3, 9, 27]]
    resident = load_engine(tmp_path, compile=False)
    want = resident.generate(prompts, max_new_tokens=16, stop_ids=()).token_ids
    reader = ExpertReader(tmp_path, expert_extents(tmp_path, resident.spec), torch.float32)
    experts = resident.decoder.layers[3].ffn.experts
    for e in range(experts.num_experts):
        for got, kernel, weight, width in zip(reader.read(3, e), experts.kernels, experts.resident_weights(e),
                                              experts.in_features):
            assert torch.equal(got, kernel.hub(weight, width))
    paged = load_engine(tmp_path, offload=OffloadOptions("34%"), compile=False)
    try:
        assert paged.generate(prompts, max_new_tokens=16, stop_ids=()).token_ids == want
        assert paged.store.stats()["hit_rate"] < 1.0  # experts were really paged in and out
    finally:
        paged.close()
