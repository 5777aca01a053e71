"""Every MHA family, loaded from a tiny checkpoint transformers wrote, computes what transformers computes.

Per case: the full-prompt fp32 logits match transformers' forward; prefill followed by one-token
decode steps through the cache gives the full-prompt logits again; rows of a left-padded batch give
what each prompt gives alone; and the experts chosen per token are the ones transformers' router chose.
"""

from __future__ import annotations

import pytest
import torch

from tiny_checkpoints import CASES, full_logits, left_padded, load_ours, prompt, write_checkpoint

transformers = pytest.importorskip("transformers")

TOL = 1e-4


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def pair(request, tmp_path_factory):
    case = request.param
    folder = tmp_path_factory.mktemp(case.id)
    reference = write_checkpoint(case, folder)
    return case, reference, load_ours(folder)


def test_full_prompt_logits_match_transformers(pair):
    case, reference, ours = pair
    ids = prompt(case.seed)
    with torch.no_grad():
        want = reference(ids).logits.float()
    got = full_logits(ours, ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < TOL


def test_decoding_through_the_cache_gives_the_full_prompt_logits(pair):
    case, _, ours = pair
    ids = prompt(case.seed)
    t = ids.shape[1]
    want = full_logits(ours, ids)
    cache = ours.new_cache(1, t)
    steps = [ours(ids[:, :7], cache, torch.arange(7)[None])]
    for i in range(7, t):
        steps.append(ours(ids[:, i : i + 1], cache, torch.tensor([[i]])))
    assert cache.length == t
    assert (torch.cat(steps, dim=1) - want).abs().max().item() < TOL


def test_left_padded_rows_match_each_prompt_alone(pair):
    case, _, ours = pair
    ids = prompt(case.seed)[0]
    rows = [ids, ids[:13], ids[5:11]]
    padded, mask, positions = left_padded(rows)
    width = padded.shape[1]
    follow = torch.tensor([[7], [9], [11]])
    cache = ours.new_cache(len(rows), width + 1)
    cache.key_mask[:, :width] = mask
    prefill = ours(padded, cache, positions)
    decode = ours(follow, cache, positions[:, -1:] + 1)
    for i, row in enumerate(rows):
        n = len(row)
        alone = ours.new_cache(1, n + 1)
        want_prefill = ours(row[None], alone, torch.arange(n)[None])
        want_decode = ours(follow[i : i + 1], alone, torch.tensor([[n]]))
        assert (prefill[i, width - n :] - want_prefill[0]).abs().max().item() < TOL
        assert (decode[i] - want_decode[0]).abs().max().item() < TOL
        assert torch.isfinite(prefill[i]).all()  # pad queries produce no NaN


def _router_hooks(model):
    """Capture transformers' (logits, weights, ids) from every router module, in layer order."""
    seen = []
    handles = [
        m.register_forward_hook(lambda _m, _inp, out: seen.append(out))
        for name, m in model.named_modules()
        if type(m).__name__.lower().endswith("topkrouter")
    ]
    return seen, handles


def test_chosen_experts_and_weights_match_transformers(pair):
    case, reference, ours = pair
    if not ours.spec.moe_layers:
        pytest.skip("dense family: nothing routed")
    ids = prompt(case.seed)
    seen, handles = _router_hooks(reference)
    try:
        with torch.no_grad():
            reference(ids)
    finally:
        for h in handles:
            h.remove()
    decisions: list = []
    cache = ours.new_cache(1, ids.shape[1])
    ours(ids, cache, torch.arange(ids.shape[1])[None], decisions=decisions)
    assert [layer for layer, _ in decisions] == list(ours.spec.moe_layers)
    assert len(seen) == len(decisions)
    for (_, decision), (_, want_weights, want_ids) in zip(decisions, seen):
        got_ids, order = decision.topk_ids.sort(dim=-1)
        ref_ids, ref_order = want_ids.sort(dim=-1)
        assert torch.equal(got_ids, ref_ids)
        got_w = decision.topk_weights.gather(1, order)
        ref_w = want_weights.float().gather(1, ref_order)
        assert decision.topk_weights.dtype == torch.float32
        assert (got_w - ref_w).abs().max().item() < 1e-5
