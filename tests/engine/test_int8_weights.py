"""`weights="int8"`: an engine whose projections are q8_0 blocks, held to its reference kernels."""

from __future__ import annotations

import pytest
import torch

from moekit.engine.loader import load_engine
from moekit.errors import MoekitError
from moekit.model.experts import RoutedExperts
from moekit.model.linear import INT8, INT8_GEMV, Linear
from moekit.model.moe import Router

pytest.importorskip("transformers")

IDS = torch.tensor([[1, 17, 42, 99, 5, 63, 120, 7], [3, 4, 5, 6, 7, 8, 9, 10]])  # [B, T]


def _logits(engine) -> torch.Tensor:
    dec = engine.decoder
    b, t = IDS.shape
    with torch.inference_mode():
        return dec(IDS, dec.new_cache(b, t), torch.arange(t).expand(b, t))  # [B, T, V]


def _to_reference(engine) -> None:
    """Every int8 operator swapped for the dequantize-and-matmul reference, in place."""
    for sub in engine.decoder.modules():
        if isinstance(sub, Linear) and sub.kernel is INT8_GEMV:
            sub.kernel = INT8
        if isinstance(sub, RoutedExperts):
            sub.form.kernels = tuple(INT8 if k is INT8_GEMV else k for k in sub.kernels)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_engine_equals_its_reference_kernels(tiny_checkpoints, family, dtype):
    engine = load_engine(tiny_checkpoints(family), dtype=dtype, weights="int8", compile=False)
    fast = _logits(engine)
    _to_reference(engine)
    want = _logits(engine)
    tol = 1e-4 if dtype == "float32" else 3e-2  # bf16: activations round between layers
    assert (fast - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_int8_logits_stay_close_to_fp32(tiny_checkpoints, family):
    folder = tiny_checkpoints(family)
    full, quantized = _logits(load_engine(folder, compile=False)), _logits(load_engine(folder, weights="int8", compile=False))
    # Not equal: a random tiny model routes near ties, and a flipped expert moves a position's
    # logits a lot. But every position's logits point the same way.
    cosine = torch.nn.functional.cosine_similarity(quantized, full, dim=-1)  # [B, T]
    assert cosine.median().item() > 0.999 and (cosine > 0.99).float().mean().item() >= 0.75


def test_int8_quantizes_every_projection_but_routers_and_int8_experts_only_the_experts(tiny_checkpoints):
    folder = tiny_checkpoints("qwen3_moe")
    every = load_engine(folder, weights="int8", compile=False)
    experts = load_engine(folder, weights="int8-experts", compile=False)
    for engine, others in ((every, True), (experts, False)):
        for sub in engine.decoder.modules():
            if isinstance(sub, RoutedExperts):
                assert all(k in (INT8, INT8_GEMV) for k in sub.kernels)
            elif isinstance(sub, Router):
                assert sub.kernel not in (INT8, INT8_GEMV) and sub.weight.is_floating_point()
            elif isinstance(sub, Linear):
                assert (sub.kernel in (INT8, INT8_GEMV)) is others
    assert any("int8" in note for note in every.notes)
    gen = every.generate(IDS.tolist(), max_new_tokens=4, stop_ids=())
    assert [len(row) for row in gen.token_ids] == [4, 4]


def test_int8_with_an_expert_budget_pages_int8_experts(tiny_checkpoints):
    # Exactness against the resident int8 engine: tests/offload/test_precision.py.
    from moekit.offload.options import OffloadOptions

    engine = load_engine(tiny_checkpoints("qwen3_moe"), weights="int8", offload=OffloadOptions("50%"), compile=False)
    try:
        assert engine.store is not None and "int8" in engine.store.precision
    finally:
        engine.close()


def test_unknown_weights_are_refused(tiny_checkpoints):
    with pytest.raises(MoekitError, match="int8-experts"):
        load_engine(tiny_checkpoints("qwen3_moe"), weights="int4", compile=False)
