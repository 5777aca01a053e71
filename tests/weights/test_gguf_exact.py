"""A GGUF runs as the checkpoint it was converted from: llama.cpp's converter on tiny random
checkpoints, then moekit on the GGUF against moekit and transformers on the safetensors, and
against transformers' own GGUF loader on the same file.

Bounds asserted (and measured on these checkpoints; docs/BENCHMARKS.md has the table):
  F32    logits within 1e-5 of both (measured 0 against moekit's safetensors, <= 5e-7 against
         transformers), greedy tokens identical; BF16 bit-identical to the bfloat16 load.
  Q8_0   (every matrix Q8_0, 256 wide) relative RMS logit error < 0.05 of the F32 GGUF's (measured
         0.019; max 0.087 of a max logit of 4.04); transformers' GGUF loader within 1e-5.
  Q4_0 / Q4_K / Q6_K: transformers' GGUF loader on the same file within 1e-5 / 1e-4.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from gguf_convert import rewrite_gguf, tiny_checkpoint
from moekit.engine.loader import load_engine

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
PROMPT = [5, 17, 42, 99, 7, 150, 3, 280]
NEW = 16


def last_logits(engine, prompt=PROMPT) -> torch.Tensor:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        return engine.decoder(ids, engine.decoder.new_cache(1, len(prompt)), torch.arange(len(prompt))[None])[0]


def greedy(engine, prompt=PROMPT) -> list[int]:
    return engine.generate([prompt], max_new_tokens=NEW, stop_ids=()).token_ids[0]


def transformers_reference(folder, gguf_file=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    # transformers' GGUF config mapping drops expert_feed_forward_length: give it the checkpoint's config.
    kwargs = {"gguf_file": gguf_file.name, "config": AutoConfig.from_pretrained(folder)} if gguf_file else {}
    where = gguf_file.parent if gguf_file else folder
    return AutoModelForCausalLM.from_pretrained(where, attn_implementation="eager", **kwargs).eval()


def reference_run(model, prompt=PROMPT) -> tuple[torch.Tensor, list[int]]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        logits = model(ids).logits[0]
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW, pad_token_id=0, eos_token_id=None)
    return logits, out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_is_the_checkpoint(converted, family):
    folder, gguf = converted(family, "f32")
    from_gguf, from_safetensors = load_engine(gguf, compile=False), load_engine(folder, compile=False)
    want_logits, want_tokens = reference_run(transformers_reference(folder))
    got = last_logits(from_gguf)
    torch.testing.assert_close(got, last_logits(from_safetensors), rtol=0, atol=1e-5)
    torch.testing.assert_close(got, want_logits, rtol=0, atol=1e-5)
    assert greedy(from_gguf) == greedy(from_safetensors) == want_tokens
    assert from_gguf.eos_ids == from_safetensors.eos_ids == (2,)
    assert replace(from_gguf.spec, name=from_safetensors.spec.name) == from_safetensors.spec


def test_transformers_reads_the_same_gguf(wide, wide_q8_0):
    """The second oracle: transformers' own GGUF loader (qwen3_moe; it refuses olmoe and mixtral's
    llama-with-experts, and mis-shapes qwen2moe's shared_expert_gate in this version)."""
    folder, gguf = wide[0], wide_q8_0
    want_logits, want_tokens = reference_run(transformers_reference(folder, gguf))
    engine = load_engine(gguf, compile=False)
    # 1e-4, the project's bound between two summation orders of the same fp32 products (the eager
    # step's row operator and transformers' GEMM; 1.0e-5 apart on one of 2,400 logits, measured).
    torch.testing.assert_close(last_logits(engine), want_logits, rtol=0, atol=1e-4)
    assert greedy(engine) == want_tokens


def test_bf16_gguf_is_the_checkpoint_at_bfloat16(converted):
    """The converter rounds to bf16 as moekit's bfloat16 load does: the same engine, bit for bit."""
    folder, gguf = converted("qwen2_moe", "bf16")
    from_gguf, from_safetensors = load_engine(gguf, dtype="bfloat16", compile=False), load_engine(folder, dtype="bfloat16", compile=False)
    assert torch.equal(last_logits(from_gguf), last_logits(from_safetensors))
    assert greedy(from_gguf) == greedy(from_safetensors)


def test_f16_gguf_is_close_to_f32(converted):
    _, f32 = converted("olmoe", "f32")
    _, f16 = converted("olmoe", "f16")
    ref, got = last_logits(load_engine(f32, compile=False)), last_logits(load_engine(f16, compile=False))
    assert ((got - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item() < 1e-3


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A qwen3_moe 256 wide (a K-quant block is 256 weights, a Q4_0 block 32) and its F32 GGUF."""
    from gguf_convert import convert

    folder = tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("wide"), hidden_size=256,
                             moe_intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return folder, convert(folder, "f32", folder.parent / "wide-f32.gguf")


@pytest.fixture(scope="module")
def wide_q8_0(wide):
    """The wide model's Q8_0 GGUF: every matrix Q8_0 (the converter keeps rows that are not a
    multiple of 32, all of the 48-wide tiny models', at F16/F32)."""
    from gguf_convert import convert

    folder, _ = wide
    return convert(folder, "q8_0", folder.parent / "wide-q8_0.gguf")


def test_q8_0_is_close_to_f32(wide, wide_q8_0):
    _, f32 = wide
    q8 = wide_q8_0
    exact, quantized = load_engine(f32, compile=False), load_engine(q8, compile=False)
    assert any("Q8_0 dequantized" in n for n in quantized.notes), quantized.notes
    ref, got = last_logits(exact), last_logits(quantized)
    err = (got - ref).abs().max().item()
    rel_rms = ((got - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
    print(f"Q8_0: max |logit error| {err:.4f} of max |logit| {ref.abs().max().item():.3f}, relative RMS {rel_rms:.4f}")
    assert rel_rms < 0.05, rel_rms
    assert err < 0.1 * ref.abs().max().item(), err


def _q4_0(name, w):
    from gguf import GGMLQuantizationType, quants

    if w.ndim < 2 or w.shape[-1] % 32 or "ffn_gate_inp" in name:  # llama-quantize keeps routers as they are
        return None
    return quants.quantize(np.ascontiguousarray(w), GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0


# K-quant blocks (256 weights each): gguf-py dequantizes but cannot quantize them, so the experts get
# random blocks with a small scale; layouts from gguf.quants (Q4_K: d, dmin f16 first; Q6_K: d last).
K_BLOCK = {"Q4_K": (144, (0, 2), 1e-3), "Q6_K": (210, (208,), 2e-4)}


def _k_quant(qtype: str, seed: int):
    from gguf import GGMLQuantizationType

    size, d_at, d = K_BLOCK[qtype]
    rng = np.random.default_rng(seed)

    def replace(name, w):
        if "_exps" not in name:
            return None
        blocks = rng.integers(0, 256, size=(*w.shape[:-1], w.shape[-1] // 256, size), dtype=np.uint8)
        for at in d_at:
            blocks[..., at : at + 2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
        return blocks.reshape(*w.shape[:-1], -1), GGMLQuantizationType[qtype]

    return replace


def test_q8_0_gguf_requantizes_to_its_own_bytes(wide_q8_0):
    """`--weights int8` on a Q8_0 GGUF runs the file's own blocks: moekit's q8_0 of each dequantized
    weight is byte for byte the GGUF's (same layout, same roundf; the block maximum is ±127·d).
    (The engine is not the checkpoint's at int8: the GGUF's embedding is Q8_0 too, moekit's stays float.)"""
    from moekit.model.int8 import quantize_q8_0
    from moekit.weights.gguf_checkpoint import open_gguf

    ckpt = open_gguf(wide_q8_0)
    checked = 0
    for name, source in ckpt.files.items():
        t = ckpt.gguf.tensors[source.tensor]
        if t.qtype == "Q8_0":
            stored = np.asarray(t.data if source.expert is None else t.data[source.expert])
            assert np.array_equal(quantize_q8_0(ckpt.get(name)).numpy(), stored), name
            checked += 1
    assert checked >= 2 * 3 * 8  # every expert's gate, up and down at least


def test_q4_0_gguf_matches_transformers_and_stays_near_f32(wide, tmp_path):
    folder, f32 = wide
    q4 = rewrite_gguf(f32, tmp_path / "q4_0.gguf", tensor=_q4_0)
    engine = load_engine(q4, compile=False)
    assert any("Q4_0 dequantized" in n for n in engine.notes), engine.notes
    want_logits, want_tokens = reference_run(transformers_reference(folder, q4))
    got = last_logits(engine)
    torch.testing.assert_close(got, want_logits, rtol=1e-5, atol=1e-5)
    assert greedy(engine) == want_tokens
    ref = last_logits(load_engine(f32, compile=False))
    # Random weights are Q4_0's worst case (no outliers to spend the 4 bits on): a loose bound.
    rel_rms = ((got - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
    print("Q4_0 relative RMS logit error", rel_rms)
    assert rel_rms < 0.5, rel_rms  # measured 0.34 (Q8_0 on the same shape: see test_q8_0_is_close_to_f32)


@pytest.mark.parametrize("qtype", sorted(K_BLOCK))
def test_k_quant_experts_match_transformers(wide, tmp_path, qtype):
    """Experts stored as Q4_K / Q6_K: moekit splits, dequantizes and places them as transformers'
    GGUF loader does."""
    folder, f32 = wide
    quantized = rewrite_gguf(f32, tmp_path / f"{qtype}.gguf", tensor=_k_quant(qtype, seed=1))
    engine = load_engine(quantized, compile=False)
    assert any(f"{qtype} dequantized" in n for n in engine.notes), engine.notes
    want_logits, want_tokens = reference_run(transformers_reference(folder, quantized))
    torch.testing.assert_close(last_logits(engine), want_logits, rtol=1e-4, atol=1e-4)
    assert greedy(engine) == want_tokens
