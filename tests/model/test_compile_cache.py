"""The compiled decode step's artefacts kept between compiles (moekit.model.compile_cache).

A second compile of the same decoder into the same folder must load what the first wrote (no new
generated code) and give the same logits; the folder's key must tell apart what must not share
compiled graphs: dtypes, weight forms, model shapes. The kernels Inductor generates are shared by
the models under one cache: a kernel one model's compile built is another's, not built again.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from moekit.engine.loader import load_engine
from moekit.model.compile_cache import is_cached, kernels_folder, step_key
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
    assert cold.written and not _libraries(first.cache_folder)  # the kernels are in the shared folder
    assert _libraries(kernels_folder(first.cache_folder))

    said = []
    second = CompiledStep(decoder, cpp_wrapper=False, cache=cold.root)
    assert second.cache_folder == first.cache_folder
    second.warm_up((1,), say=said.append)
    assert said[0].startswith("loading the compiled decode step (batch 1) from"), said
    assert _generated(cold.root) == cold.written  # loaded, not generated again: graphs nor kernels
    torch.testing.assert_close(_step_logits(decoder, second), cold.logits, rtol=0, atol=0)


def _libraries(folder) -> dict:
    """Every kernel library under folder, by path below it, with the time it was written."""
    return {p.relative_to(folder): p.stat().st_mtime_ns for p in folder.rglob("*.so")}


@pytest.fixture(scope="module")
def int8_compiled_alone(tiny_checkpoints, tmp_path_factory):
    """tiny qwen3_moe's int8 decoder, its batch-1 step compiled into an empty cache, and its logits."""
    decoder = load_engine(tiny_checkpoints("qwen3_moe"), weights="int8", compile=True).decoder
    root = tmp_path_factory.mktemp("int8-alone")
    first = CompiledStep(decoder, cpp_wrapper=False, cache=root)
    first.warm_up((1,))
    return decoder, first, _step_logits(decoder, first)


def test_an_int8_decoders_graphs_are_saved_and_loaded_by_a_later_step(int8_compiled_alone):
    """Every tensor an int8 graph reads (its q8_0 expert stacks too) is one the decoder holds by
    name, so the graph is recorded, saved, and loaded by the next step without tracing it again."""
    decoder, first, want = int8_compiled_alone
    assert first.graphs, "the int8 step was not recorded as a direct graph"
    second = CompiledStep(decoder, cpp_wrapper=False, cache=first.cache_folder.parent)
    second.warm_up((1,))
    assert second.loaded_graphs == 1
    torch.testing.assert_close(_step_logits(decoder, second), want, rtol=0, atol=0)


def test_a_second_model_under_the_cache_builds_only_the_kernels_the_first_did_not(
        qwen3_compiled_cold, int8_compiled_alone, tmp_path):
    """The int8 decoder compiled where the fp32 one was (a copy of its cache): its graphs go in a
    folder of its own and the fp32 one's stay as they were (a model never loads another's graph),
    while the kernels the two graphs share (the norms, rope, routing around the products) are
    loaded from the fp32 compile's, not built again: it builds only what it built alone less
    those, and its logits are those of the int8 step compiled alone."""
    cold = qwen3_compiled_cold
    decoder, alone, want = int8_compiled_alone
    shutil.copytree(cold.root, tmp_path, dirs_exist_ok=True)
    fp32_folder = tmp_path / cold.step.cache_folder.name
    fp32_graphs = _generated(fp32_folder)
    built = _libraries(tmp_path)

    step = CompiledStep(decoder, cpp_wrapper=False, cache=tmp_path)
    step.warm_up((1,))
    assert step.loaded_graphs == 0 and is_cached(step.cache_folder) and step.cache_folder != fp32_folder
    assert _generated(fp32_folder) == fp32_graphs
    libraries = _libraries(tmp_path)
    assert {p.parts[0] for p in libraries} == {kernels_folder(step.cache_folder).name}  # none in a model's folder
    assert {p: libraries[p] for p in built} == built  # none of the fp32 compile's built again
    alone_names, built_names = {p.name for p in _libraries(alone.cache_folder.parent)}, {p.name for p in built}
    assert alone_names & built_names, "the two graphs share no kernel: this test checks nothing"
    assert {p.name for p in libraries} - built_names == alone_names - built_names
    torch.testing.assert_close(_step_logits(decoder, step), want, rtol=0, atol=0)


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

