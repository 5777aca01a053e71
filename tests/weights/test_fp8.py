"""Block-scaled FP8 as DeepSeek-V3 publishes it, held to transformers.

Two oracles, because transformers' FP8 dequantization derives the block from the scale grid and so
refuses partial blocks (DeepSeek-V3's own kv_a_proj_with_mqa is 576 rows, 4.5 blocks):
  whole blocks    transformers loads the FP8 file itself (on CPU it dequantizes at load: no GPU);
  partial blocks  transformers loads the fp32 checkpoint dequantized by the test's obvious loop
                  (quantized_files.obvious_fp8_dequantize), moekit the FP8 file.
fp32 both: the same weights, logits within summation order; measured max |Δ| 2.7e-6 (whole, of
logits up to 3.5) and 2.4e-6 (partial, of 3.2) with the compiled operator, ~1e-6 with the reference
kernel (bound asserted: 1e-5). Greedy continuations identical.
"""

from __future__ import annotations

import pytest
import torch

from moekit.engine.loader import load_engine
from moekit.model.linear import Linear, fp8_kernel
from moekit.weights import fp8
from quantized_files import assert_engine_equals, dequantized_copy, obvious_fp8_dequantize, reference_model

transformers = pytest.importorskip("transformers")

PROMPT = [1, 17, 42, 99, 5, 63, 120]
NEW = 20


def _assert_same(engine, model) -> None:
    assert_engine_equals(engine, model, PROMPT, NEW)


def test_dequantize_is_transformers_on_whole_blocks():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = torch.randn(256, 384) * torch.logspace(-2, 1, 384)
    q, scale_inv = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 3)
    assert torch.equal(fp8.dequantize(q, scale_inv), Fp8Dequantize(None)._dequantize_one(q, scale_inv, torch.float32))


@pytest.mark.parametrize("shape", [(200, 300), (96, 136), (1, 129)])
def test_dequantize_is_the_format_definition_on_partial_blocks(shape):
    q, scale_inv = fp8.quantize(torch.randn(shape))
    assert scale_inv.shape == tuple(-(-n // 128) for n in shape)
    assert torch.equal(fp8.dequantize(q, scale_inv), obvious_fp8_dequantize(q, scale_inv, (128, 128)))


def test_engine_equals_transformers_loading_the_fp8_file(quantized_checkpoints):
    folder = quantized_checkpoints("fp8")
    _assert_same(load_engine(folder, compile=False), reference_model(folder))


def test_engine_with_partial_blocks_equals_transformers_on_the_dequantized_file(quantized_checkpoints, tmp_path):
    folder = quantized_checkpoints("fp8-partial")
    _assert_same(load_engine(folder, compile=False), reference_model(dequantized_copy(folder, tmp_path / "plain")))


def test_routed_experts_stay_fp8_and_dense_weights_are_dequantized(quantized_checkpoints):
    engine = load_engine(quantized_checkpoints("fp8-partial"), dtype="bfloat16", compile=False)
    ex = engine.decoder.layers[1].ffn.experts
    assert all(k in (fp8_kernel(128), fp8_kernel(128, gemv=True)) for k in ex.kernels)  # the faster one here
    gate_up, down = ex.resident_weights(0)
    d, f = ex.in_features  # 192, 96: partial blocks both ways
    assert gate_up.dtype == torch.uint8 and gate_up.shape == (2 * f, d + 4 * 2)  # codes, then 2 block scales
    assert down.shape == (d, f + 4 * 1)
    dense = [m for m in engine.decoder.modules() if isinstance(m, Linear)]
    assert dense and all(m.weight.is_floating_point() for m in dense)
    gen = engine.generate(PROMPT, max_new_tokens=4, stop_ids=())
    assert len(gen.token_ids[0]) == 4


def test_the_meter_counts_the_fp8_bytes_of_the_experts_a_token_reads(quantized_checkpoints):
    from moekit.engine.meter import params_per_token

    engine = load_engine(quantized_checkpoints("fp8"), dtype="bfloat16", compile=False)
    d, f = engine.decoder.layers[1].ffn.experts.in_features  # 256, 128
    packed = 2 * f * (d + 4 * 2) + d * (f + 4 * 1)  # one byte a weight + each row's block scales
    counts = params_per_token(engine.spec)
    for token in engine.meter(engine.generate(PROMPT, max_new_tokens=4, stop_ids=())):
        used = {layer: len(set(ids)) for layer, ids in token.experts.items()}
        routed = sum(counts.expert_each[layer] * n for layer, n in used.items())
        assert token.bytes_touched == (token.params_touched - routed) * 2 + sum(used.values()) * packed


def test_kimi_k2_reads_the_same_fp8_layout(quantized_checkpoints, tmp_path):
    """Kimi-K2 publishes DeepSeek-V3's architecture and FP8 layout under model_type kimi_k2
    (transformers has no kimi_k2 class: the oracle is the deepseek_v3 engine on the same bytes)."""
    import json
    import shutil

    folder = shutil.copytree(quantized_checkpoints("fp8-partial"), tmp_path / "kimi")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    kimi, deepseek = load_engine(folder, compile=False), load_engine(quantized_checkpoints("fp8-partial"), compile=False)
    assert kimi.spec.model_type == "kimi_k2"
    assert kimi.decoder.layers[1].ffn.experts.kernels == deepseek.decoder.layers[1].ffn.experts.kernels
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        a = kimi.decoder(ids, kimi.decoder.new_cache(1, len(PROMPT)), torch.arange(len(PROMPT))[None])
        b = deepseek.decoder(ids, deepseek.decoder.new_cache(1, len(PROMPT)), torch.arange(len(PROMPT))[None])
    assert torch.equal(a, b)
