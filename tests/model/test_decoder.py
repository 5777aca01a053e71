"""Decoder behaviour beyond one family's numbers: bf16, routing records, cache handling."""

from __future__ import annotations

import copy

import pytest
import torch

from moekit.model.moe import Router
from tiny_checkpoints import CASES, full_logits, load_ours, prompt, write_checkpoint

pytest.importorskip("transformers")

BY_ID = {c.id: c for c in CASES}


@pytest.fixture(scope="module", params=["mixtral-a", "gpt_oss-window", "qwen2_moe-dense-layer"])
def written(request, tmp_path_factory):
    case = BY_ID[request.param]
    folder = tmp_path_factory.mktemp(case.id)
    return case, write_checkpoint(case, folder), folder


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(written):
    case, reference, folder = written
    ids = prompt(case.seed)
    with torch.no_grad():
        exact = reference(ids).logits.float()
        theirs = copy.deepcopy(reference).to(torch.bfloat16)(ids).logits.float()
    ours = load_ours(folder, torch.bfloat16)
    got = full_logits(ours, ids)
    assert got.dtype == torch.float32
    their_err = (theirs - exact).abs().max().item()
    assert (got - exact).abs().max().item() < 3 * their_err + 0.02
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


def test_bf16_weights_with_fp32_routers_where_the_reference_scores_in_fp32(written):
    _, _, folder = written
    ours = load_ours(folder, torch.bfloat16)
    for module in ours.modules():
        for name, p in module.named_parameters(recurse=False):
            want = torch.float32 if isinstance(module, Router) and module.spec.fp32 else torch.bfloat16
            assert p.dtype == want, f"{type(module).__name__}.{name}"


def test_decisions_record_every_token_of_every_moe_layer(written):
    case, _, folder = written
    ours = load_ours(folder)
    ids = torch.cat([prompt(case.seed)[:, :9], prompt(case.seed + 1)[:, :9]])  # B = 2, T = 9
    decisions: list = []
    ours(ids, ours.new_cache(2, 9), torch.arange(9).expand(2, 9), decisions=decisions)
    assert [layer for layer, _ in decisions] == list(ours.spec.moe_layers)
    for layer, d in decisions:
        k = ours.spec.layers[layer].ffn.top_k
        assert d.topk_ids.shape == (18, k) and d.topk_weights.shape == (18, k)
        assert int(d.topk_ids.max()) < ours.spec.layers[layer].ffn.num_experts
        # every row routes to K distinct experts
        assert all(len(set(row)) == k for row in d.topk_ids.tolist())


def test_cache_made_under_inference_mode_is_usable_outside_it(written):
    case, _, folder = written
    ours = load_ours(folder)
    ids = prompt(case.seed)
    with torch.inference_mode():
        cache = ours.new_cache(1, ids.shape[1])
    got = ours(ids, cache, torch.arange(ids.shape[1])[None])
    assert torch.equal(got, full_logits(ours, ids))


def test_a_full_cache_refuses_more_tokens(written):
    case, _, folder = written
    ours = load_ours(folder)
    cache = ours.new_cache(1, 4)
    ours(prompt(case.seed)[:, :4], cache, torch.arange(4)[None])
    with pytest.raises(ValueError, match="4 slots"):
        ours(prompt(case.seed)[:, :1], cache, torch.tensor([[4]]))


def test_last_only_gives_the_last_position_of_the_full_logits(written):
    case, _, folder = written
    ours = load_ours(folder)
    ids = torch.cat([prompt(case.seed)[:, :9], prompt(case.seed + 1)[:, :9]])  # B = 2, T = 9
    positions = torch.arange(9).expand(2, 9)
    full = ours(ids, ours.new_cache(2, 9), positions)
    last = ours(ids, ours.new_cache(2, 9), positions, last_only=True)
    assert last.shape == (2, 1, ours.spec.vocab_size)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-6, rtol=0)
