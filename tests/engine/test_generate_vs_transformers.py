"""The oracle: greedy generation token for token equal to transformers' generate, every family.

Checkpoints are tiny random models written by transformers' save_pretrained (the Hub's names);
both sides load the same folder from disk.
"""

from __future__ import annotations

import pytest
import torch

from hf_tiny import DENSE_FAMILIES, MOE_FAMILIES
from moekit.engine.loader import load_engine

transformers = pytest.importorskip("transformers")

PROMPT = [1, 17, 42, 99, 5, 63, 120]
NEW = 24


def reference(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
    # No eos: both sides run the full length. (min_new_tokens would instead forbid eos, which a
    # free-running engine may legitimately choose.)
    model.generation_config.eos_token_id = None
    return model


def reference_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_greedy_continuation_equals_transformers(family, tiny_checkpoints):
    folder = tiny_checkpoints(family)
    engine = load_engine(folder, compile=False)
    ours = engine.generate(PROMPT, max_new_tokens=NEW, stop_ids=()).token_ids[0]
    theirs = reference_greedy(reference(folder), PROMPT, NEW)
    assert len(theirs) == NEW
    assert len(set(theirs)) >= 3, "reference continuation is degenerate; the comparison would prove little"
    assert ours == theirs


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_a_padded_batch_generates_what_each_prompt_generates_alone(family, tiny_checkpoints):
    engine = load_engine(tiny_checkpoints(family), compile=False)
    prompts = [[1, 17, 42], [3, 9, 27, 81, 100, 4, 16, 64, 2], [7, 8, 9, 10, 11]]
    batch = engine.generate(prompts, max_new_tokens=12, stop_ids=())
    alone = [engine.generate(p, max_new_tokens=12, stop_ids=()).token_ids[0] for p in prompts]
    assert batch.token_ids == alone
    assert batch.timing.batch == 3 and batch.timing.decode_steps == 11
