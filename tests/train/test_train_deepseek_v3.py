"""The deepseek_v3 layout (MLA attention, shared expert, sigmoid router) trains with selection-bias balancing."""

import json

import pytest
import torch

from moekit.train.session import train

from train_fixtures import tiny_config

DEEPSEEK = """
[model]
model_type = "deepseek_v3"
vocab_size = 320
hidden_size = 32
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 4
n_routed_experts = 8
num_experts_per_tok = 2
n_shared_experts = 1
moe_intermediate_size = 16
intermediate_size = 64
first_k_dense_replace = 1
kv_lora_rank = 16
q_lora_rank = 24
qk_nope_head_dim = 8
qk_rope_head_dim = 8
v_head_dim = 8
max_position_embeddings = 128
num_nextn_predict_layers = 0
initializer_range = 0.05
"""


def test_bias_balancing_moves_the_selection_bias_and_the_checkpoint_loads_in_transformers(tiny_corpus, tmp_path):
    config = tiny_config(tmp_path, tiny_corpus, steps=4, every=4, model=DEEPSEEK)
    config.write_text(config.read_text() + "bias_balance_rate = 0.01\n")
    result = train(config, tmp_path / "run", say=lambda s: None)
    bias = result["decoder"].layers[1].ffn.router.selection_bias
    assert bias.abs().max() > 0 and bias.max() > 0 > bias.min()  # some experts raised, others lowered

    transformers = pytest.importorskip("transformers")
    from moekit.engine.loader import load_engine

    model_dir = tmp_path / "run" / "model"
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    engine = load_engine(model_dir, compile=False)
    ids = torch.tensor([engine.encode("import sys\nprint(sys.argv)\n")])
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = model(ids).logits[0]
        ours = engine.decoder(ids, engine.decoder.new_cache(1, ids.shape[1]), torch.arange(ids.shape[1])[None])[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
