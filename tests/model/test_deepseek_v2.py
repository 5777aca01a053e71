"""deepseek_v2 end to end (DeepSeek-V2-Lite's shape: q projected directly, YaRN with mscale = mscale_all_dim,
softmax routing without renormalisation, two shared experts): logits and greedy continuation as transformers.

V2 rotates its rope dimensions as complex pairs; MLAttention's interleaved layout must give the same result.
"""

from __future__ import annotations

import pytest
import torch

from test_deepseek_v3 import NEW_TOKENS, TINY, greedy, load_ours, prompts

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # V3's tiny shape with V2-Lite's differences: q projected directly, no group limit, two shared
    # experts, YaRN with mscale = mscale_all_dim
    overrides = dict(
        q_lora_rank=None,
        n_group=None,
        topk_group=None,
        n_shared_experts=2,
        routed_scaling_factor=1.5,
        rope_parameters={
            **TINY["rope_parameters"],
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    )
    cfg = transformers.DeepseekV2Config(**{**TINY, **overrides})
    torch.manual_seed(7)
    model = transformers.DeepseekV2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
        for layer in model.model.layers[cfg.first_k_dense_replace :]:
            layer.mlp.gate.weight.normal_(0.0, 0.5)  # clear top-K choices, not near-ties
    folder = tmp_path_factory.mktemp("deepseek_v2")
    model.save_pretrained(folder)
    return model, folder


@torch.no_grad()
def test_full_prompt_logits_match_transformers(checkpoint):
    reference, folder = checkpoint
    ours = load_ours(folder)
    ids = torch.stack(prompts(20, (20, 20)))
    got = ours(ids, ours.new_cache(2, 20), torch.arange(20).expand(2, -1))
    torch.testing.assert_close(got, reference(ids).logits.float(), atol=1e-4, rtol=0)


@torch.no_grad()
def test_greedy_continuation_matches_generate(checkpoint):
    reference, folder = checkpoint
    rows = prompts(21, (15, 6))
    got = greedy(load_ours(folder), rows, NEW_TOKENS)
    for i, row in enumerate(rows):
        expected = reference.generate(row[None], do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert got[i].tolist() == expected[0, len(row) :].tolist(), f"row {i} (prompt length {len(row)})"
