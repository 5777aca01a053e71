"""deepseek_v3 end to end: a tiny DeepseekV3ForCausalLM written by save_pretrained, loaded by our
Decoder, must give transformers' logits and transformers' greedy continuation.

The tiny models keep every DeepSeek-V3 feature that changes the numbers: MLA with q LoRA and YaRN,
a dense first layer, sigmoid routing with a non-zero e_score_correction_bias, group-limited top-K,
one ungated shared expert, routed_scaling_factor, with and without norm_topk_prob.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from moekit.errors import CheckpointError
from moekit.model.decoder import Decoder
from moekit.spec import load_spec
from moekit.weights.checkpoint import open_checkpoint


VOCAB = 96
NEW_TOKENS = 24
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=64,  # = original 16 × factor 4, the ratio YaRN assumes
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16,  # prompt + continuation run well past it
    },
    bos_token_id=None,
    eos_token_id=None,  # greedy runs its full length: no row stops early
    pad_token_id=None,
)
VARIANTS = {
    "normalized": dict(norm_topk_prob=True),
    "unnormalized": dict(norm_topk_prob=False),
    # DeepSeek-V2-Lite's attention shape (q projected directly) under the V3 architecture
    "no_q_lora": dict(norm_topk_prob=True, q_lora_rank=None),
}


def build_reference(variant: str, seed: int):
    cfg = transformers.DeepseekV3Config(**{**TINY, **VARIANTS[variant]})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norm weights of exactly 1 would hide a norm applied in the wrong place
                p.copy_(1 + 0.2 * torch.randn_like(p))
        for layer in model.model.layers[cfg.first_k_dense_replace :]:
            # init std 0.02 leaves sigmoid scores nearly tied; spread them so top-K choices are clear,
            # and give the selection bias enough weight to change which experts win
            layer.mlp.gate.weight.normal_(0.0, 0.5)
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    """(reference model, folder it was saved to)."""
    folder = tmp_path_factory.mktemp(f"deepseek_v3_{request.param}")
    model = build_reference(request.param, seed=sorted(VARIANTS).index(request.param))
    model.save_pretrained(folder)
    return model, folder


def load_ours(folder, dtype: torch.dtype = torch.float32) -> Decoder:
    decoder = Decoder(load_spec(str(folder)), dtype=dtype)
    decoder.load_checkpoint(open_checkpoint(folder))
    return decoder


def prompts(seed: int, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def left_padded(rows: list[torch.Tensor], max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [B, W], positions [B, W], key_mask [B, max_len]) for prompts padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    key_mask = torch.ones(len(rows), max_len, dtype=torch.bool)
    for i, row in enumerate(rows):
        pad = width - len(row)
        ids[i, pad:] = row
        positions[i, pad:] = torch.arange(len(row))
        key_mask[i, :pad] = False
    return ids, positions, key_mask


@torch.no_grad()
def greedy(decoder: Decoder, rows: list[torch.Tensor], new_tokens: int) -> torch.Tensor:
    """Our Decoder + KVCache, argmax each step. → [B, new_tokens]"""
    width = max(len(r) for r in rows)
    cache = decoder.new_cache(len(rows), width + new_tokens)
    ids, positions, cache.key_mask = left_padded(rows, width + new_tokens)
    logits = decoder(ids, cache, positions)
    next_pos = positions[:, -1:] + 1
    out = []
    for _ in range(new_tokens):
        token = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        out.append(token)
        logits = decoder(token, cache, next_pos)
        next_pos = next_pos + 1
    return torch.cat(out, dim=1)


@torch.no_grad()
def test_full_prompt_logits_match_transformers(checkpoint):
    reference, folder = checkpoint
    ours = load_ours(folder)
    ids = torch.stack(prompts(10, (20, 20)))
    expected = reference(ids).logits.float()
    cache = ours.new_cache(2, 20)
    got = ours(ids, cache, torch.arange(20).expand(2, -1))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_moe_layers_route_like_transformers(checkpoint):
    """The experts each token chose, layer by layer (set equality: order inside top-K is free)."""
    reference, folder = checkpoint
    ours = load_ours(folder)
    ids = torch.stack(prompts(11, (20,)))
    chosen = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, args, out, i=i: chosen.__setitem__(i, out[2]))
        for i, layer in enumerate(reference.model.layers)
        if hasattr(layer.mlp, "gate")
    ]
    reference(ids)
    for h in hooks:
        h.remove()
    decisions: list = []
    ours(ids, ours.new_cache(1, 20), torch.arange(20)[None], decisions=decisions)
    assert [i for i, _ in decisions] == sorted(chosen) == [1, 2]
    for i, decision in decisions:
        assert torch.equal(decision.topk_ids.sort(-1).values, chosen[i].sort(-1).values), f"layer {i}"


@torch.no_grad()
def test_greedy_continuation_matches_generate(checkpoint):
    reference, folder = checkpoint
    ours = load_ours(folder)
    rows = prompts(12, (17, 9))  # batched with left padding on our side, alone on the reference's
    got = greedy(ours, rows, NEW_TOKENS)
    for i, row in enumerate(rows):
        expected = reference.generate(row[None], do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert got[i].tolist() == expected[0, len(row) :].tolist(), f"row {i} (prompt length {len(row)})"


@torch.no_grad()
def test_bf16_weights_err_no_more_than_transformers_own_bf16(checkpoint):
    """bf16 weights (router and its bias kept fp32) against the fp32 reference: no further off than
    transformers' own model cast to bf16 on the same input, and at least as many argmax agreements.
    (A fixed tolerance would have to exceed the typical gap between the top two logits, ~0.035 here.)"""
    reference, folder = checkpoint
    ours = load_ours(folder, torch.bfloat16)
    ids = torch.stack(prompts(14, (20, 20)))
    expected = reference(ids).logits.float()
    theirs = copy.deepcopy(reference).to(torch.bfloat16)(ids).logits.float()
    got = ours(ids, ours.new_cache(2, 20), torch.arange(20).expand(2, -1))
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    ours_err, their_err = (got - expected).abs(), (theirs - expected).abs()
    assert ours_err.max() <= 1.5 * their_err.max(), (ours_err.max().item(), their_err.max().item())
    assert ours_err.mean() <= 1.5 * their_err.mean(), (ours_err.mean().item(), their_err.mean().item())
    agree = lambda logits: (logits.argmax(-1) == expected.argmax(-1)).float().mean()
    assert agree(got) >= agree(theirs)


def test_mtp_layers_in_the_checkpoint_are_ignored(checkpoint, tmp_path):
    """DeepSeek-V3 ships its multi-token-prediction module as model.layers.{L}.*; the decoder skips it."""
    reference, folder = checkpoint
    layers = reference.config.num_hidden_layers
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(48, 96)
    tensors[f"model.layers.{layers}.enorm.weight"] = torch.ones(48)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    ours = load_ours(tmp_path)
    ids = torch.stack(prompts(13, (8,)))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids, ours.new_cache(1, 8), torch.arange(8)[None]), reference(ids).logits, atol=1e-4, rtol=0
        )


def test_missing_latent_projection_is_named(checkpoint, tmp_path):
    _, folder = checkpoint
    tensors = load_file(str(folder / "model.safetensors"))
    missing = "model.layers.2.self_attn.kv_b_proj.weight"
    del tensors[missing]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        load_ours(tmp_path)
