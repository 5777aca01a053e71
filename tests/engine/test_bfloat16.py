"""bfloat16: the engine routes as transformers does in bf16, and generates the same text wherever
transformers' own fp32 and bf16 runs agree (where they do not, rounding decides, not the engine)."""

from __future__ import annotations

import pytest
import torch

from hf_tiny import MOE_FAMILIES, reference_routing
from moekit.engine.generate import token_routing
from moekit.engine.loader import load_engine
from test_generate_vs_transformers import reference, reference_greedy

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 17, 42, 99, 5], [3, 9, 27, 81], [100, 101, 7, 64, 12, 33], [8, 150, 44]]
NEW = 24


def _our_routing(engine, sequence: list[int]) -> dict[int, list[list[int]]]:
    """Routing of every token of `sequence` in one prefill (one new token is generated and ignored)."""
    gen = engine.generate(sequence, max_new_tokens=1, stop_ids=())
    chosen: dict[int, list[list[int]]] = {}
    for ev in token_routing(gen):
        chosen.setdefault(ev.layer, []).append(ev.expert_ids)
    return chosen


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bf16_routing_and_text_match_transformers_bf16(family, tiny_checkpoints):
    folder = tiny_checkpoints(family)
    engine = load_engine(folder, dtype="bfloat16")
    ref32 = reference(folder)
    ref16 = reference(folder, dtype=torch.bfloat16)

    pairs = same = 0
    comparable = 0
    for prompt in PROMPTS:
        greedy32 = reference_greedy(ref32, prompt, NEW)
        greedy16 = reference_greedy(ref16, prompt, NEW)
        sequence = prompt + greedy32
        theirs = reference_routing(ref16, sequence)
        ours = _our_routing(engine, sequence)
        assert sorted(ours) == sorted(theirs)
        for layer in ours:
            for a, b in zip(ours[layer], theirs[layer], strict=True):
                pairs += 1
                same += sorted(a) == sorted(b)
        if greedy32 == greedy16:
            comparable += 1
            assert engine.generate(prompt, max_new_tokens=NEW, stop_ids=()).token_ids[0] == greedy16
    assert same / pairs >= 0.99, f"{pairs - same} of {pairs} token x layer routing decisions differ"
    assert comparable >= 1, "no prompt where transformers' fp32 and bf16 agree: text comparison proved nothing"
