"""bfloat16: the engine routes as transformers does in bf16, and generates the same text, wherever
the outcome is decided by the model rather than by rounding.

"Decided by the model" is read off transformers itself. A routing decision counts when
transformers' own fp32 and bf16 runs agree on it. Greedy text counts up to the first token whose
fp32 top-2 logits are closer than bf16 rounding moves them (such a step is a coin toss for any
bf16 implementation) or where transformers' bf16 already left its fp32 path.
"""

from __future__ import annotations

import pytest
import torch

from hf_tiny import MOE_FAMILIES, reference_routing
from moekit.engine.generate import token_routing
from moekit.engine.loader import load_engine
from test_generate_vs_transformers import reference, reference_greedy

transformers = pytest.importorskip("transformers")

PROMPTS = [
    [1, 17, 42, 99, 5],
    [3, 9, 27, 81],
    [100, 101, 7, 64, 12, 33],
    [8, 150, 44],
    [60, 61, 62, 63, 64, 65, 66],
    [11, 22],
]
NEW = 24


def _decided_prefix(ref32, ref16, prompt: list[int], greedy32: list[int], greedy16: list[int]) -> int:
    """How many leading tokens of the continuation the model, not rounding, decides.

    At each step the fp32 gap between the top two logits must exceed twice the amount by which
    transformers' own bf16 run moves those two logits (our bf16 moves them about as much).
    """
    ids = torch.tensor([prompt + greedy32])
    rows = slice(len(prompt) - 1, len(prompt) - 1 + len(greedy32))
    with torch.inference_mode():
        l32 = ref32(input_ids=ids).logits[0, rows].float()  # [NEW, V]
        l16 = ref16(input_ids=ids).logits[0, rows].float()
    top2 = l32.topk(2, dim=-1)
    gap = top2.values[:, 0] - top2.values[:, 1]  # [NEW]
    noise = (l16 - l32).abs().gather(1, top2.indices).sum(dim=-1)  # [NEW]
    for i, (g, n, a, b) in enumerate(zip(gap.tolist(), noise.tolist(), greedy32, greedy16)):
        if g <= 2 * n or a != b:
            return i
    return len(greedy32)


def _our_routing(engine, sequence: list[int]) -> dict[int, list[list[int]]]:
    """Routing of every token of `sequence` in one prefill (one new token is generated and ignored)."""
    gen = engine.generate(sequence, max_new_tokens=1, stop_ids=())
    chosen: dict[int, list[list[int]]] = {}
    for ev in token_routing(gen):
        chosen.setdefault(ev.layer, []).append(sorted(ev.expert_ids))
    return chosen


def _sorted(routing: dict[int, list[list[int]]]) -> dict[int, list[list[int]]]:
    return {layer: [sorted(ids) for ids in rows] for layer, rows in routing.items()}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bf16_routing_and_text_match_transformers_bf16(family, tiny_checkpoints):
    folder = tiny_checkpoints(family)
    engine = load_engine(folder, dtype="bfloat16", compile=False)
    ref32 = reference(folder)
    ref16 = reference(folder, dtype=torch.bfloat16)

    comparable_pairs = same_pairs = all_pairs = 0
    compared_tokens = 0
    for prompt in PROMPTS:
        greedy32 = reference_greedy(ref32, prompt, NEW)
        greedy16 = reference_greedy(ref16, prompt, NEW)
        sequence = prompt + greedy32
        theirs32 = _sorted(reference_routing(ref32, sequence))
        theirs16 = _sorted(reference_routing(ref16, sequence))
        ours = _our_routing(engine, sequence)
        assert sorted(ours) == sorted(theirs16)
        for layer in ours:
            for mine, t16, t32 in zip(ours[layer], theirs16[layer], theirs32[layer], strict=True):
                all_pairs += 1
                if t16 == t32:
                    comparable_pairs += 1
                    same_pairs += mine == t16
        decided = _decided_prefix(ref32, ref16, prompt, greedy32, greedy16)
        ours_text = engine.generate(prompt, max_new_tokens=NEW, stop_ids=()).token_ids[0]
        assert ours_text[:decided] == greedy16[:decided]
        compared_tokens += decided
    assert comparable_pairs >= 0.9 * all_pairs
    assert same_pairs >= 0.99 * comparable_pairs, (
        f"{comparable_pairs - same_pairs} of {comparable_pairs} comparable routing decisions differ"
    )
    # Tiny random models have close logits: about a third to a half of their tokens are decided.
    assert compared_tokens >= 0.2 * NEW * len(PROMPTS), f"only {compared_tokens} tokens decided by the model"
