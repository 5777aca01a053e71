"""MXFP4 as gpt-oss publishes it, held to transformers' own dequantization of the same file.

On CPU transformers dequantizes MXFP4 at load (quantizer_mxfp4: no triton / use_kernels off), to
the model's dtype; in fp32 every FP4 value × 2^e is exact, so both sides hold the same weights and
the logits differ only by summation order: measured max |Δ| 1.3e-6 with the reference kernel and
7.8e-7 with the compiled operator, over logits of magnitude 1.6 (bound asserted: 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from moekit.engine.loader import load_engine
from moekit.model.linear import MXFP4, MXFP4_GEMV
from moekit.weights import mxfp4
from quantized_files import assert_engine_equals, reference_model

transformers = pytest.importorskip("transformers")

PROMPT = [1, 17, 42, 99, 5, 63, 120]
NEW = 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_is_transformers_convert_moe_packed_tensors(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 64, 96) * torch.logspace(-3, 2, 96)  # [E, out, in], blocks of very different scales
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (3, 64, 3, 16) and scales.shape == (3, 64, 3)
    got = mxfp4.dequantize_stack(blocks, scales, dtype)  # [E, in, out]
    assert torch.equal(got, convert_moe_packed_tensors(blocks, scales, dtype=dtype))


def test_quantize_keeps_values_that_are_fp4_times_a_power_of_two():
    codes = torch.randint(0, 16, (8, 64))
    exps = torch.randint(-8, 8, (8, 2)).repeat_interleave(32, dim=1)
    w = torch.ldexp(torch.tensor(mxfp4.FP4_VALUES)[codes], exps)
    w[:, ::32] = torch.ldexp(torch.full((8, 2), 6.0), exps[:, ::32])  # each block's max is 6·2^e
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(w)), w)


def test_engine_equals_transformers_on_the_published_layout(quantized_checkpoints):
    folder = quantized_checkpoints("mxfp4")
    assert_engine_equals(load_engine(folder, compile=False), reference_model(folder), PROMPT, NEW)


def test_experts_stay_packed_at_four_and_a_quarter_bits(quantized_checkpoints):
    engine = load_engine(quantized_checkpoints("mxfp4"), dtype="bfloat16", compile=False)
    ex = engine.decoder.layers[0].ffn.experts
    assert all(k in (MXFP4, MXFP4_GEMV) for k in ex.kernels)  # the operator where it measured faster
    gate_up, down = ex.resident_weights(0)
    d, f = ex.in_features
    assert gate_up.dtype == torch.uint8 and gate_up.shape == (2 * f, d // 32 * 17)
    assert down.dtype == torch.uint8 and down.shape == (d, f // 32 * 17)
    params = (2 * f * d + d * f) * ex.num_experts
    stored = sum(w.numel() for pair in map(ex.resident_weights, range(ex.num_experts)) for w in pair)
    assert stored * 8 / params == 4.25
    gen = engine.generate(PROMPT, max_new_tokens=4, stop_ids=())
    assert len(gen.token_ids[0]) == 4


def test_the_meter_counts_the_packed_bytes_of_the_experts_a_token_reads(quantized_checkpoints):
    from moekit.engine.meter import params_per_token

    engine = load_engine(quantized_checkpoints("mxfp4"), dtype="bfloat16", compile=False)
    d, f = engine.decoder.layers[0].ffn.experts.in_features
    packed = (2 * f * d + d * f) * 17 // 32 + (2 * f + d) * 2  # FP4 codes + E8M0 scales, bf16 biases
    counts = params_per_token(engine.spec)
    for token in engine.meter(engine.generate(PROMPT, max_new_tokens=4, stop_ids=())):
        used = {layer: len(set(ids)) for layer, ids in token.experts.items()}
        routed = sum(counts.expert_each[layer] * n for layer, n in used.items())
        assert token.bytes_touched == (token.params_touched - routed) * 2 + sum(used.values()) * packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 24])
def test_the_grouped_experts_are_the_combine_bit_for_bit(quantized_checkpoints, dtype, tokens):
    """The packed form runs a prompt's (or a batch's) chosen experts as two moekit::experts_mxfp4
    calls where the rows operator is the experts' kernel: the same floats as the combine, which runs
    each expert on its own rows and adds their shares in its order."""
    from moekit.model.expert_forms import Packed
    from moekit.model.routing import RoutingDecision

    engine = load_engine(quantized_checkpoints("mxfp4"), dtype=str(dtype).split(".")[1])
    ex = engine.decoder.layers[0].ffn.experts
    assert isinstance(ex.held, Packed)
    if ex.kernels != (MXFP4_GEMV, MXFP4_GEMV):
        pytest.skip("the reference measured faster than the rows operator here: the combine runs")
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, ex.in_features[0], generator=gen).to(dtype)
    logits = torch.randn(tokens, ex.num_experts, generator=gen)
    top, ids = logits.topk(min(4, ex.num_experts), dim=-1)
    decision = RoutingDecision(ids, torch.softmax(top, dim=-1))
    with torch.inference_mode():
        got = ex.held.apply(ex, x, decision)
        want = ex.combine(x, decision, ex.held.weights)
    assert got.dtype == dtype and torch.equal(got, want)



def _batch_logits(engine) -> torch.Tensor:
    """A 2-row prefill, then 3 decode steps' logits [2, 3, V] (the compiled engine's through its graph)."""
    dec, cache = engine.decoder, engine.decoder.new_cache(2, 16)
    prompts = torch.tensor([PROMPT + [7], [12, 40, 41, 2, 7, 8, 9, 10]])
    with torch.inference_mode():
        dec(prompts, cache, torch.arange(8)[None].expand(2, 8))
        return torch.cat([dec(torch.tensor([[17 + s], [23 + s]]), cache, torch.full((2, 1), 8 + s)) for s in range(3)], 1)


def test_a_bf16_engines_compiled_step_stays_within_bf16_rounding_of_its_eager_step(quantized_checkpoints):
    """bf16 activations reach moekit::experts_mxfp4 as bf16 (its bf16 pair product, where built) in
    the compiled step as in the eager one; the two steps round the experts' shares and their sum in
    bf16 in other orders (a fused sum against the eager adds), so logits agree to bf16's rounding."""
    folder = quantized_checkpoints("mxfp4")
    eager = load_engine(folder, dtype="bfloat16", compile=False)
    compiled = load_engine(folder, dtype="bfloat16", compile=True)
    compiled.decoder.compile_decode(cpp_wrapper=False)  # the same kernels, a quicker compile
    assert compiled.decoder.compiled is not None, compiled.notes
    want, got = _batch_logits(eager), _batch_logits(compiled)
    assert got.dtype == want.dtype and want.abs().max() > 0.5  # logits of some size, so that the bound means something
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.06)
