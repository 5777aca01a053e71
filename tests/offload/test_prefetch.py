"""The prefetch guess: a layer's router applied ahead of time, scored by what the layer then chose."""

from __future__ import annotations

import pytest
import torch

from hf_tiny import write_checkpoint
from moekit.engine.loader import load_engine
from moekit.offload.options import OffloadOptions
from moekit.offload.prefetch import predict_experts


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("prefetch"), seed=3)
    engine = load_engine(folder, compile=False)
    yield engine
    engine.close()


def test_a_guess_from_the_layers_own_input_is_its_choice(engine):
    """Given the residual the layer itself normalises, the guess with no extra IS the router's top-K."""
    block = engine.decoder.layers[1]
    seen = {}

    def capture(x):
        seen["x"] = x.clone()

    block.before_ffn = capture
    decisions = []
    try:
        cache = engine.decoder.new_cache(1, 8)
        engine.decoder(torch.tensor([[5, 17, 42, 9]]), cache, torch.arange(4)[None], decisions=decisions)
    finally:
        block.before_ffn = None
    chosen = dict(decisions)[1].topk_ids
    assert predict_experts(block, seen["x"], extra=0, limit=8) == sorted(set(chosen.reshape(-1).tolist()))
    wider = predict_experts(block, seen["x"], extra=2, limit=8)
    assert set(chosen.reshape(-1).tolist()) <= set(wider) and len(wider) <= 8
    assert len(predict_experts(block, seen["x"], extra=2, limit=3)) == 3  # the most pointed-to three


def test_prefetch_scores_every_guessed_layer_and_never_the_first(tmp_path):
    folder = write_checkpoint("qwen3_moe", tmp_path / "q", seed=3, num_hidden_layers=3)
    engine = load_engine(folder, offload=OffloadOptions("50%", prefetch=True, prefetch_extra=1), compile=False)
    try:
        engine.generate([5, 17, 42, 9, 77], max_new_tokens=12, stop_ids=())
        layers = engine.store.stats()["layers"]
    finally:
        engine.close()
    assert layers["0"]["prefetch_recall"] is None  # nothing runs ahead of the first MoE layer
    for name in ("1", "2"):
        assert 0 < layers[name]["prefetch_recall"] <= 1 and 0 < layers[name]["prefetch_precision"] <= 1
