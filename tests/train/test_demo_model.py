"""The shipped demo model: transformers loads it and greedy-generates what moekit's engine generates,
and it has the figures docs/DEMO_MODEL.md publishes."""

import json

import torch
import transformers

from cli_runner import moekit
from demo_figures import ACTIVE_PARAMS, DEMO, E, K, LAYERS, TOTAL_PARAMS

PROMPTS = ["def parse_args(argv):", "NAME\n    ls - list directory contents\n\nDESCRIPTION\n"]


def test_transformers_greedy_equals_the_engine_on_the_demo_model():
    from moekit.engine.loader import load_engine

    engine = load_engine(DEMO, compile=False)  # fp32: the bf16 weights widen exactly
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


def test_the_demo_model_has_the_published_figures():
    """128 experts, 2 per token in every layer, 19,427,744 parameters of which 9.35% active."""
    from safetensors import safe_open

    from moekit.calc.params import count_params
    from moekit.spec import load_spec

    spec = load_spec(str(DEMO))
    assert len(spec.layers) == LAYERS and spec.moe_layers == tuple(range(LAYERS))
    assert {(l.ffn.num_experts, l.ffn.router.top_k) for l in spec.layers} == {(E, K)}
    counts = count_params(spec)
    assert (counts.total_params, counts.active_params) == (TOTAL_PARAMS, ACTIVE_PARAMS)
    assert f"{counts.active_params / counts.total_params:.2%}" == "9.35%"
    with safe_open(str(DEMO / "model.safetensors"), framework="pt") as fh:  # what is really stored
        assert sum(torch.Size(fh.get_slice(name).get_shape()).numel() for name in fh.keys()) == TOTAL_PARAMS
    assert sum(p.stat().st_size for p in DEMO.iterdir()) <= 40_000_000


def test_the_demo_model_beats_the_unigram_baseline_on_python(capsys, tiny_corpus):
    """`moekit eval` puts the model against a unigram fit on the corpus' train split: on held-out
    standard-library Python (the demo model's training domain) it must win by far; on the corpus'
    generated word salad, which it never saw, the unigram fit to exactly that salad wins."""
    code, out, err = moekit(capsys, "eval", DEMO, "--corpus", tiny_corpus, "--json", "--max-tokens", "600")
    assert code == 0, err
    domains = json.loads(out)["domains"]
    python, prose = domains["python"], domains["prose"]
    assert python["perplexity"] * 10 < python["unigram_perplexity"]
    assert prose["perplexity"] > prose["unigram_perplexity"]
