"""The compiled decode step's artefacts kept between compiles (moekit.model.compile_cache).

A second compile of the same decoder into the same folder must load what the first wrote (no new
generated code) and give the same logits; the folder's key must tell apart what must not share
compiled code: dtypes, weight forms, model shapes.
"""

from __future__ import annotations

import torch

from moekit.engine.loader import load_engine
from moekit.model.compile_cache import is_cached, step_key
from moekit.model.compiled_step import CompiledStep


def _generated(folder):
    """Every file the compiles wrote under folder (the caches' entries, generated code, libraries),
    but the locks."""
    return sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file() and p.parent.name != "locks")


def _step_logits(decoder, step) -> torch.Tensor:
    decoder.compiled = step
    cache = decoder.new_cache(1, 8)
    with torch.inference_mode():
        decoder(torch.tensor([[5, 9, 33]]), cache, torch.tensor([[0, 1, 2]]))
        return torch.cat([decoder(torch.tensor([[t]]), cache, torch.tensor([[3 + s]])) for s, t in enumerate((7, 81))], 1)


def test_a_second_compile_loads_what_the_first_wrote(qwen3_compiled_cold):
    """The first compile: tests/model/conftest.py's, into an empty folder (test_saved_graphs starts from it too)."""
    cold = qwen3_compiled_cold
    decoder, first, said = cold.decoder, cold.step, cold.said
    assert said[0].startswith("compiling the decode step (batch 1)") and str(first.cache_folder) in said[0], said
    assert said[1].endswith(" s")
    assert first.cache_folder.parent == cold.root and is_cached(first.cache_folder)
    assert cold.written

    said = []
    second = CompiledStep(decoder, cpp_wrapper=False, cache=cold.root)
    assert second.cache_folder == first.cache_folder
    second.warm_up((1,), say=said.append)
    assert said[0].startswith("loading the compiled decode step (batch 1) from"), said
    assert _generated(second.cache_folder) == cold.written  # loaded, not generated again
    torch.testing.assert_close(_step_logits(decoder, second), cold.logits, rtol=0, atol=0)


def test_an_int8_decoders_graphs_are_saved_and_loaded_by_a_later_step(tiny_checkpoints, tmp_path):
    """Every tensor an int8 graph reads (its q8_0 expert stacks too) is one the decoder holds by
    name, so the graph is recorded, saved, and loaded by the next step without tracing it again."""
    decoder = load_engine(tiny_checkpoints("qwen3_moe"), weights="int8", compile=True).decoder
    first = CompiledStep(decoder, cpp_wrapper=False, cache=tmp_path)
    first.warm_up((1,))
    assert first.graphs, "the int8 step was not recorded as a direct graph"
    want = _step_logits(decoder, first)
    second = CompiledStep(decoder, cpp_wrapper=False, cache=tmp_path)
    second.warm_up((1,))
    assert second.loaded_graphs == 1
    torch.testing.assert_close(_step_logits(decoder, second), want, rtol=0, atol=0)


def test_the_key_tells_dtypes_weight_forms_and_shapes_apart(tiny_checkpoints):
    options = {"cpp_wrapper": False}
    keys = {}
    for family, dtype, weights in (("qwen3_moe", "float32", "dtype"), ("qwen3_moe", "float32", "dtype"),
                                   ("qwen3_moe", "bfloat16", "dtype"), ("qwen3_moe", "float32", "int8-experts"),
                                   ("olmoe", "float32", "dtype")):
        decoder = load_engine(tiny_checkpoints(family), dtype=dtype, weights=weights, compile=True).decoder
        keys.setdefault((family, dtype, weights), set()).add(step_key(decoder, options))
    assert all(len(k) == 1 for k in keys.values())  # the same decoder, the same key
    assert len({k for ks in keys.values() for k in ks}) == len(keys)
    assert step_key(decoder, options) != step_key(decoder, {"cpp_wrapper": True})

