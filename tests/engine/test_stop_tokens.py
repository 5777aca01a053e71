"""Stop tokens end a row (the stop token is kept, as transformers keeps eos); other rows go on."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from hf_tiny import write_checkpoint
from moekit.engine.loader import load_engine


def test_a_stop_token_ends_its_row_only(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("mixtral"), compile=False)
    prompts = [[1, 17, 42, 99], [5, 6, 7]]
    free = engine.generate(prompts, max_new_tokens=16, stop_ids=())
    row0 = free.token_ids[0]
    stop = row0[5]
    first = row0.index(stop)
    stopped = engine.generate(prompts, max_new_tokens=16, stop_ids=[stop])
    assert stopped.token_ids[0] == row0[: first + 1]
    assert stopped.stopped[0]
    row1 = free.token_ids[1]
    expected1 = row1[: row1.index(stop) + 1] if stop in row1 else row1
    assert stopped.token_ids[1] == expected1


def test_generation_ends_early_when_every_row_has_stopped(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("mixtral"), compile=False)
    first = engine.generate([1, 17, 42], max_new_tokens=1, stop_ids=()).token_ids[0][0]
    gen = engine.generate([1, 17, 42], max_new_tokens=30, stop_ids=[first])
    assert gen.token_ids == [[first]]
    assert gen.timing.decode_steps == 0


def test_the_models_eos_stops_by_default(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    assert engine.eos_ids == (2,)
    free = engine.generate([1, 17, 42], max_new_tokens=8, stop_ids=()).token_ids[0]
    # Stop on what the model says next: with that id as eos, the default stops right there.
    engine.eos_ids = (free[2],)
    assert engine.generate([1, 17, 42], max_new_tokens=8).token_ids[0] == free[: free.index(free[2]) + 1]


def test_a_checkpoint_stops_on_its_own_eos_where_transformers_does(tiny_checkpoints, tmp_path):
    """The same weights saved with an eos the model really emits (the default 2 it never does within
    the run): moekit stops on that id read from the folder, at the step transformers' generate stops."""
    prompt = [1, 17, 42]
    free = load_engine(tiny_checkpoints("qwen3_moe"), compile=False).generate(prompt, max_new_tokens=8, stop_ids=()).token_ids[0]
    eos = free[3]
    assert eos != 2 and 2 not in free
    folder = write_checkpoint("qwen3_moe", tmp_path / "own_eos", eos_token_id=eos)  # same seed: same weights
    engine = load_engine(folder, compile=False)
    assert eos in engine.eos_ids
    gen = engine.generate(prompt, max_new_tokens=8)
    assert gen.token_ids[0] == free[: free.index(eos) + 1] and gen.stopped == [True]
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        theirs = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
    assert gen.token_ids[0] == theirs[0, len(prompt):].tolist()
