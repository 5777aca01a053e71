"""gpt-oss's MXFP4 GGUF (what llama.cpp and Ollama users download): moekit reads it resident with its
experts kept packed, and generates the tokens of the published mxfp4 safetensors of the same weights."""

from __future__ import annotations

import pytest

from moekit.bench.make_checkpoint import make_checkpoint
from moekit.engine.loader import load_engine

GPT_OSS = dict(model_type="gpt_oss", vocab_size=384, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
               sliding_window=4, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("oss")
    return (make_checkpoint(GPT_OSS, "gguf-mxfp4", root / "m.gguf", seed=7).path,
            make_checkpoint(GPT_OSS, "mxfp4", root / "safetensors", seed=7).path)


def test_the_gguf_generates_the_safetensors_mxfp4_tokens_with_experts_kept_packed(pair):
    gguf, safetensors = (load_engine(p, compile=False) for p in pair)
    ids = safetensors.tokenizer.encode("the sliding window is four tokens long").ids  # longer than the window
    assert gguf.tokenizer.encode("the sliding window is four tokens long").ids == ids
    want = safetensors.generate([ids], max_new_tokens=6, stop_ids=()).token_ids
    assert gguf.generate([ids], max_new_tokens=6, stop_ids=()).token_ids == want
    assert gguf.expert_bytes(1, 3) == safetensors.expert_bytes(1, 3)  # packed: 4.25 bits a weight on both
    assert any("MXFP4 experts kept packed" in n for n in gguf.notes)
