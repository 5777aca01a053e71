"""In bf16, experts kept packed compute what the same experts dequantized at load compute: the
kernels dequantize exactly (MXFP4) or as transformers does (FP8: fp32 product, then bf16), then run
the same bf16 F.linear. Held to the dequantized checkpoint loaded by moekit itself, bit for bit."""

from __future__ import annotations

import pytest
import torch

from moekit.engine.loader import load_engine
from moekit.model.experts import RoutedExperts
from moekit.model.linear import MXFP4, MXFP4_GEMV, fp8_kernel
from quantized_files import dequantized_copy

pytest.importorskip("transformers")

IDS = torch.tensor([[1, 17, 42, 99, 5, 63, 120, 7]])  # [B, T]


REFERENCE = {MXFP4_GEMV: MXFP4, fp8_kernel(128, gemv=True): fp8_kernel(128)}
OPERATOR = {v: k for k, v in REFERENCE.items()}


def _swap(engine, table):
    for sub in engine.decoder.modules():
        if isinstance(sub, RoutedExperts):
            sub.form.kernels = tuple(table.get(k, k) for k in sub.kernels)
    return engine


def _to_reference(engine):
    """The compiled operators (another summation order) swapped for the reference kernels."""
    return _swap(engine, REFERENCE)


def _logits(engine) -> torch.Tensor:
    dec = engine.decoder
    with torch.inference_mode():
        return dec(IDS, dec.new_cache(1, IDS.shape[1]), torch.arange(IDS.shape[1])[None])  # [B, T, V]


@pytest.mark.parametrize("kind", ["mxfp4", "fp8-partial"])
def test_packed_experts_in_bf16_equal_the_dequantized_checkpoint(quantized_checkpoints, tmp_path, kind):
    folder = quantized_checkpoints(kind)
    packed = _to_reference(load_engine(folder, dtype="bfloat16", compile=False))
    plain = load_engine(dequantized_copy(folder, tmp_path / "plain"), dtype="bfloat16", compile=False)
    assert torch.equal(_logits(packed), _logits(plain))
    prompt = IDS[0].tolist()
    assert packed.generate(prompt, max_new_tokens=8, stop_ids=()).token_ids == plain.generate(
        prompt, max_new_tokens=8, stop_ids=()).token_ids


@pytest.mark.parametrize("kind", ["mxfp4", "fp8-partial"])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_the_compiled_operators_stay_close_to_the_reference_kernels(quantized_checkpoints, kind, dtype, tol):
    engine = _swap(_to_reference(load_engine(quantized_checkpoints(kind), dtype=dtype, compile=False)), OPERATOR)  # whatever was faster here
    fast = _logits(engine)  # 8 tokens: each expert's rows (≤ 8) within the operator's reach
    want = _logits(_to_reference(engine))
    assert (fast - want).abs().max().item() <= tol * want.abs().max().item()
