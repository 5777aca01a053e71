"""A prompt prefilled on the Hub layout (what a compiled engine's prefill runs: the routed experts
as two grouped GEMMs over the stacks) gives what the eager layout's prefill gives: the same greedy
tokens (which test_generate_vs_transformers holds to transformers') and logits within fp32 noise,
on every family, for a lone prompt, a padded batch, and a prompt prefilled after a cached part."""

from __future__ import annotations

import pytest
import torch

from hf_tiny import MOE_FAMILIES
from moekit.engine.generate import generate
from moekit.engine.loader import load_engine
from moekit.model.decoder import Decoder
from moekit.model.experts import RoutedExperts
from moekit.weights.checkpoint import open_checkpoint
from moekit.weights.gguf_spec import load_any_spec

PROMPTS = [[1, 17, 42, 99, 5, 63, 120, 3, 9, 27, 81, 100, 4, 16, 64, 2], [7, 8, 9]]


def hub_layout(folder) -> Decoder:
    decoder = Decoder(load_any_spec(folder))
    ckpt = open_checkpoint(folder)
    decoder.load_checkpoint(ckpt, kernels=False)
    ckpt.close()
    return decoder.eval()


def prefill_logits(decoder, ids: list[int], split: int | None = None) -> torch.Tensor:
    """[T, V] logits of one prompt, in one forward or in two (the second after the first's KV)."""
    cache = decoder.new_cache(1, len(ids))
    positions = torch.arange(len(ids))[None]
    with torch.inference_mode():
        if split is None:
            return decoder(torch.tensor([ids]), cache, positions)[0]
        first = decoder(torch.tensor([ids[:split]]), cache, positions[:, :split])[0]
        return torch.cat([first, decoder(torch.tensor([ids[split:]]), cache, positions[:, split:])[0]])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_hub_layouts_prefill_gives_the_eager_layouts_tokens(family, tiny_checkpoints):
    folder = tiny_checkpoints(family)
    eager = load_engine(folder, compile=False).decoder
    hub = hub_layout(folder)
    grouped = [m for m in hub.modules() if isinstance(m, RoutedExperts) and m._stacks_grouped(torch.zeros(2, 1))]
    assert grouped or family in ("gpt_oss", "llama4_text"), "the grouped GEMMs should run here"  # biases / weighed inputs
    for prompts in (PROMPTS[:1], PROMPTS):
        want = generate(eager, prompts, 12, stop_ids=()).token_ids
        assert generate(hub, prompts, 12, stop_ids=()).token_ids == want, f"{family}: {len(prompts)} prompts"
    whole = prefill_logits(eager, PROMPTS[0])
    torch.testing.assert_close(prefill_logits(hub, PROMPTS[0]), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(prefill_logits(hub, PROMPTS[0], split=5), whole, atol=1e-4, rtol=1e-4)
