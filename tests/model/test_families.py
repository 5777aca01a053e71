"""Every MHA family, loaded from a tiny checkpoint transformers wrote, computes what transformers computes.

Per case: the full-prompt fp32 logits match transformers' forward; prefill followed by one-token
decode steps through the cache gives the full-prompt logits again; rows of a left-padded batch give
what each prompt gives alone; in an MoE case the experts chosen per token are the ones transformers'
router chose, and a dense case routes nothing and has every parameter active.
"""

from __future__ import annotations

import pytest
import torch

from tiny_checkpoints import CASES, full_logits, left_padded, load_ours, prompt, write_checkpoint

TOL = 1e-4
DENSE_FAMILIES = {"llama", "mistral", "qwen2", "qwen3"}
MOE_CASES = [c for c in CASES if c.family not in DENSE_FAMILIES]
DENSE_CASES = [c for c in CASES if c.family in DENSE_FAMILIES]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case -> (case, transformers reference, our decoder), each checkpoint written once."""
    made = {}

    def get(case):
        if case.id not in made:
            folder = tmp_path_factory.mktemp(case.id)
            made[case.id] = (case, write_checkpoint(case, folder), load_ours(folder))
        return made[case.id]

    return get


@pytest.fixture
def pair(request, built):
    return built(request.param)


def cases(which):
    return pytest.mark.parametrize("pair", which, ids=lambda c: c.id, indirect=True)


@cases(CASES)
def test_full_prompt_logits_match_transformers(pair):
    case, reference, ours = pair
    ids = prompt(case.seed)
    with torch.no_grad():
        want = reference(ids).logits.float()
    got = full_logits(ours, ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < TOL


@cases(CASES)
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


@cases(CASES)
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


@cases(MOE_CASES)
def test_chosen_experts_and_weights_match_transformers(pair):
    case, reference, ours = pair
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


@cases(DENSE_CASES)
def test_a_dense_model_routes_nothing_and_every_parameter_is_active(pair):
    """What a dense family has instead of a router: one MLP per layer, all of it used by every token,
    so the calculator's total is transformers' own parameter count and the active share is exactly 1."""
    from moekit.calc.params import count_params

    case, reference, ours = pair
    assert ours.spec.moe_layers == () and not any(layer.is_moe for layer in ours.spec.layers)
    decisions: list = []
    ids = prompt(case.seed)
    ours(ids, ours.new_cache(1, ids.shape[1]), torch.arange(ids.shape[1])[None], decisions=decisions)
    assert decisions == []
    counts = count_params(ours.spec)
    assert counts.total_params == sum(p.numel() for p in reference.parameters())  # tied weights once
    assert counts.active_params == counts.total_params and counts.active_fraction == 1.0
