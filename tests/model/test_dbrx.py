"""dbrx: fused Wqkv with clip_qkv, bias-free LayerNorms, a router whose K weights are divided by
their p-norm, experts stored as [E*F, D] rows — greedy tokens and logits equal to transformers'."""

from __future__ import annotations


import pytest
import torch


from hf_tiny import FAMILIES, assert_engine_matches_reference, build_reference
from moekit.engine.loader import load_engine

PROMPT = [1, 17, 42, 99, 5, 63, 120]
FFN = FAMILIES["dbrx"]["ffn_config"]
ATTN = FAMILIES["dbrx"]["attn_config"]
VARIANTS = {
    "clipped, L1": {},
    # transformers 5.24 cannot run clip_qkv=None (clamp(None, None) raises): a clip nothing reaches.
    "no clip": {"attn_config": {**ATTN, "clip_qkv": 100.0}},
    "L2 norm": {"ffn_config": {**FFN, "moe_normalize_expert_weights": 2.0}},
    "unnormalised": {"ffn_config": {**FFN, "moe_normalize_expert_weights": None}},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dbrx_generates_what_transformers_generates(variant, tmp_path):
    assert_engine_matches_reference("dbrx", tmp_path, PROMPT, seed=2, **VARIANTS[variant])


def test_clip_qkv_matters_here(tmp_path):
    """The tiny config's clip is small enough to cut some q/k/v values: without it the logits move."""
    build_reference("dbrx", seed=2).save_pretrained(tmp_path / "clipped")
    build_reference("dbrx", seed=2, **VARIANTS["no clip"]).save_pretrained(tmp_path / "free")
    ids = torch.tensor([PROMPT])
    logits = []
    for name in ("clipped", "free"):
        dec = load_engine(tmp_path / name, compile=False).decoder
        logits.append(dec(ids, dec.new_cache(1, len(PROMPT)), torch.arange(len(PROMPT))[None]))
    assert not torch.allclose(logits[0], logits[1], atol=1e-3)
