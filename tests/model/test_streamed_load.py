"""`--weights int8` quantizes each projection as it is read (moekit.model.loading.load_into with
int8): the decoder it leaves is, parameter for parameter, the one a whole load at the dtype then
quantize_decoder gives, and it generates the same tokens. MLA's projections (fused at prepare)
are quantized after, as before; the GGUF forms are held in tests/weights/test_gguf_streamed_load.py.
"""

from __future__ import annotations

import pytest
import torch

from moekit.engine.generate import generate
from moekit.model import loading
from moekit.model.decoder import Decoder
from moekit.model.int8 import quantize_decoder
from moekit.model.linear import INT8, INT8_GEMV, Linear
from moekit.spec import load_spec
from moekit.weights.checkpoint import open_checkpoint

pytest.importorskip("transformers")

PROMPTS = [[1, 17, 42, 99, 5, 63], [3, 4, 5, 6, 7, 8]]


def loaded(folder, dtype: torch.dtype, streamed: bool, kernels: bool) -> Decoder:
    decoder = Decoder(load_spec(folder), dtype=dtype)
    ckpt = open_checkpoint(folder)
    decoder.load_checkpoint(ckpt, kernels=kernels, int8=streamed)
    ckpt.close()
    quantize_decoder(decoder)
    return decoder


def assert_same(a: Decoder, b: Decoder) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        x, y = (t.to_dense() if t.is_mkldnn else t for t in (pa[name], pb[name]))  # oneDNN's packed bf16 layouts
        assert x.dtype == y.dtype and torch.equal(x, y), name
    kernels = [(n, m.kernel) for n, m in a.named_modules() if isinstance(m, Linear)]
    assert kernels == [(n, m.kernel) for n, m in b.named_modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_int8_load_is_the_whole_load_then_quantized(tiny_checkpoints, family, dtype):
    folder = tiny_checkpoints(family)
    for kernels in (False, True):  # the compiled step's Hub layout, and the eager kernels' layouts
        streamed, whole = loaded(folder, dtype, True, kernels), loaded(folder, dtype, False, kernels)
        assert_same(streamed, whole)
    assert any(isinstance(m, Linear) and m.kernel in (INT8, INT8_GEMV) for m in streamed.modules())
    got = generate(streamed, PROMPTS, max_new_tokens=6, stop_ids=()).token_ids
    assert got == generate(whole, PROMPTS, max_new_tokens=6, stop_ids=()).token_ids


def test_a_large_weight_is_quantized_a_few_rows_at_a_time_to_the_same_bytes(tiny_checkpoints, monkeypatch):
    """CHUNK rows of 4 bytes each: every matrix goes through the row loop, in several chunks."""
    folder = tiny_checkpoints("qwen3_moe")
    whole = loaded(folder, torch.bfloat16, False, False)
    monkeypatch.setattr(loading, "CHUNK", 3 * 4 * 48)  # three rows of the 48-wide tiny model
    assert_same(loaded(folder, torch.bfloat16, True, False), whole)
