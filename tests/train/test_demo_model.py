"""The shipped demo model: transformers loads it and greedy-generates what moekit's engine generates."""

from pathlib import Path

import pytest
import torch

DEMO = Path(__file__).resolve().parents[2] / "models" / "moekit-demo"
PROMPTS = ["def parse_args(argv):", "NAME\n    ls - list directory contents\n\nDESCRIPTION\n"]


@pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="models/moekit-demo not present")
def test_transformers_greedy_equals_the_engine_on_the_demo_model():
    transformers = pytest.importorskip("transformers")
    from moekit.engine.loader import load_engine

    engine = load_engine(DEMO)  # fp32: the bf16 weights widen exactly
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    for text in PROMPTS:
        prompt = engine.encode(text)
        ours = engine.generate(prompt, max_new_tokens=24, stop_ids=()).token_ids[0]
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=24, pad_token_id=0)
        theirs = out[0, len(prompt):].tolist()
        assert len(set(theirs)) >= 4, "a degenerate continuation would prove little"
        assert ours == theirs, text


@pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="models/moekit-demo not present")
def test_the_demo_model_is_fine_grained_sparse_and_small():
    from moekit.calc.params import count_params
    from moekit.spec import load_spec

    spec = load_spec(str(DEMO))
    counts = count_params(spec)
    moe = spec.layers[0].ffn
    assert moe.num_experts >= 32 and moe.router.top_k <= 4
    size = sum(p.stat().st_size for p in DEMO.iterdir())
    assert size <= 40_000_000
    assert counts.active_params / counts.total_params < 0.10  # the (tied) embedding counted in full
