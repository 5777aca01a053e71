"""A GGUF loaded with `--weights int8` quantizes as it reads (moekit.model.loading): a Q8_0 matrix
keeps the file's own blocks, a float one is quantized a few rows at a time, and a large tensor is
dequantized a few rows at a time. Held here against the whole load then quantize_decoder, on
llama.cpp's own conversions of a tiny qwen3_moe 256 wide (whole Q8_0 blocks in every matrix)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_convert import convert, tiny_checkpoint
from moekit.engine.generate import generate
from moekit.engine.loader import load_engine
from moekit.model import loading
from moekit.model.decoder import Decoder
from moekit.model.int8 import quantize_decoder
from moekit.model.linear import INT8, INT8_GEMV, Linear
from moekit.weights.gguf_checkpoint import open_gguf

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 99, 7, 150], [3, 4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    folder = tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("wide"), hidden_size=256,
                             moe_intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return {kind: convert(folder, kind, folder.parent / f"wide-{kind}.gguf") for kind in ("q8_0", "f32")}


def whole(gguf, dtype: torch.dtype) -> Decoder:
    """The load before streaming: every weight at the dtype, then quantize_decoder."""
    ckpt = open_gguf(gguf)
    decoder = Decoder(ckpt.spec(), dtype=dtype)
    decoder.load_checkpoint(ckpt, kernels=True, int8=False)  # as load_engine's eager decoder (compile=False)
    ckpt.close()
    quantize_decoder(decoder)
    return decoder


def streamed(gguf, dtype: torch.dtype) -> Decoder:
    return load_engine(gguf, dtype=str(dtype).removeprefix("torch."), weights="int8", compile=False,
                       kernels="reference").decoder


def params(decoder: Decoder) -> dict:
    return {name: p.to_dense() if p.is_mkldnn else p.detach() for name, p in decoder.named_parameters()}  # oneDNN's bf16 layout


@pytest.fixture(params=["whole rows", "a few rows at a time"])
def chunk(request, monkeypatch):
    if request.param != "whole rows":
        monkeypatch.setattr(loading, "CHUNK", 5 * 4 * 256)  # five rows of 256: every matrix in several reads
    return request.param


def test_q8_0_at_float32_is_the_whole_load_then_quantized(wide, chunk):
    """At float32 the file's blocks are what quantizing their dequantized values gives
    (tests/weights/test_gguf_exact.py), so nothing changes but the memory."""
    a, b = streamed(wide["q8_0"], torch.float32), whole(wide["q8_0"], torch.float32)
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)
    assert generate(a, PROMPTS, max_new_tokens=8).token_ids == generate(b, PROMPTS, max_new_tokens=8).token_ids


def test_q8_0_at_bfloat16_holds_the_files_blocks(wide, chunk):
    """At bfloat16 the whole load rounded each weight to bf16 before quantizing it again; the
    streamed load holds the file's blocks as stored, and every float tensor as the whole load does."""
    gguf = wide["q8_0"]
    a, b = streamed(gguf, torch.bfloat16), whole(gguf, torch.bfloat16)
    ckpt = open_gguf(gguf)
    stored = {"lm_head.weight": "output.weight", "layers.0.attn.o_proj.weight": "blk.0.attn_output.weight"}
    pa, pb = params(a), params(b)
    for ours, theirs in stored.items():
        assert torch.equal(pa[ours], torch.from_numpy(np.array(ckpt.gguf.tensors[theirs].data))), ours
    linears = {f"{n}.weight" for n, m in a.named_modules() if isinstance(m, Linear) and m.kernel in (INT8, INT8_GEMV)}
    assert set(stored) <= linears
    for name in pa.keys() - linears:  # embedding, norms, routers: the dtype's values of the same floats
        assert torch.equal(pa[name], pb[name]), name


def test_float_matrices_are_quantized_by_rows_to_the_whole_loads_bytes(wide, chunk):
    for dtype in (torch.float32, torch.bfloat16):
        pa, pb = params(streamed(wide["f32"], dtype)), params(whole(wide["f32"], dtype))
        assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)
