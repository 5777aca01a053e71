"""The compiled step's graphs kept on disk and called by a later process without Dynamo
(moekit.model.saved_graphs).

A step that finds a graph an earlier one saved under the same constants must load it, not trace,
and give bit-identical logits; a record made under other constants, a damaged one, or one whose
held tensors differ must be passed over (the step then traces, with the same result); a graph that
calls an operator holding a process's object by handle must never be saved.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_compile_cache import _step_logits

from moekit.engine.loader import load_engine
from moekit.model import saved_graphs
from moekit.model.compile_cache import compiling_into, kernels_folder
from moekit.model.compiled_step import CompiledStep
from moekit.model.direct_graph import named_held
from moekit.weights.manifest import MANIFEST_NAME


def _records(step) -> list:
    return sorted((step.cache_folder / saved_graphs.FOLDER).glob("*.json"))


@pytest.fixture(scope="module")
def compiled_in(qwen3_compiled_cold):
    """A decoder, the folder its first step compiled into (its graph saved there), and its logits:
    tests/model/conftest.py's cold compile, which test_compile_cache shares (the tests below write
    into copies of the folder)."""
    cold = qwen3_compiled_cold
    assert cold.step.loaded_graphs == 0 and len(_records(cold.step)) == 1
    return cold.decoder, cold.root, cold.logits


@pytest.fixture
def compiled_once(compiled_in, tmp_path):
    """The decoder, a step over a copy in tmp_path of what its first step compiled and saved (each
    test may add records or damage them), and the first step's logits."""
    decoder, folder, want = compiled_in
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    first = CompiledStep(decoder, cpp_wrapper=False, cache=tmp_path)
    assert first.cache_folder.is_dir() and len(_records(first)) == 1
    return decoder, first, want


def test_a_later_step_loads_the_saved_graph_instead_of_tracing(compiled_once, tmp_path):
    decoder, first, want = compiled_once
    second = CompiledStep(decoder, cpp_wrapper=False, cache=tmp_path)
    got = _step_logits(decoder, second)
    assert second.loaded_graphs == 1 and second.direct_steps == 2  # no step went through Dynamo
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    decoder.compiled = None
    torch.testing.assert_close(_step_logits(decoder, None), want, rtol=0, atol=1e-4)  # the eager reference


def test_another_process_runs_the_saved_graph_with_the_same_logits(qwen3_compiled_cold, tiny_checkpoints, tmp_path):
    """Two fresh processes (as two `moekit run`s are): the first traces, compiles and saves; the
    second loads what the first saved, runs no step through Dynamo, and gives the same logits.
    The cache starts with the kernels of tests/model/conftest.py's cold compile and none of its
    graphs (as after another model's compile): the first process compiles the graph, and builds no kernel."""
    kernels = kernels_folder(qwen3_compiled_cold.step.cache_folder)
    shutil.copytree(kernels, tmp_path / kernels.name)
    script = textwrap.dedent(f"""
        import sys, torch
        from pathlib import Path
        from safetensors.torch import load_file, save_file
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_compile_cache import _step_logits
        from moekit.engine.loader import load_engine
        from moekit.model.compiled_step import CompiledStep
        torch.set_num_threads(1)
        decoder = load_engine({str(tiny_checkpoints("qwen3_moe"))!r}, compile=True).decoder
        step = CompiledStep(decoder, cpp_wrapper=False, cache=Path({str(tmp_path)!r}))
        got = _step_logits(decoder, step)
        want = Path({str(tmp_path / "first.safetensors")!r})
        if want.exists():
            torch.testing.assert_close(got, load_file(want)["logits"], rtol=0, atol=0)
        else:
            save_file({{"logits": got.contiguous()}}, want)
        print("loaded", step.loaded_graphs, "direct", step.direct_steps)
    """)
    said = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        said.append(done.stdout.split())
    assert said == [["loaded", "0", "direct", "1"], ["loaded", "1", "direct", "2"]], said
    folders = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert folders == sorted([kernels.name, qwen3_compiled_cold.step.cache_folder.name])  # the same key as the cold compile


def test_a_record_made_under_other_constants_is_not_used(compiled_once, tmp_path):
    decoder, first, want = compiled_once
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # Inductor's generated loops were written for the first count
    try:
        second = CompiledStep(decoder, cpp_wrapper=False, cache=tmp_path)
        got = _step_logits(decoder, second)
    finally:
        torch.set_num_threads(threads)
    assert second.loaded_graphs == 0 and len(_records(second)) == 2  # traced, and saved under its own
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_damaged_record_is_passed_over_and_the_step_traces(compiled_once, tmp_path):
    decoder, first, want = compiled_once
    record = _records(first)[0]
    artefact = record.with_suffix(".bin")
    artefact.write_bytes(artefact.read_bytes()[:100])  # cut short
    second = CompiledStep(decoder, cpp_wrapper=False, cache=tmp_path)
    torch.testing.assert_close(_step_logits(decoder, second), want, rtol=0, atol=0)
    assert second.loaded_graphs == 0
    record.write_text("{not json")
    third = CompiledStep(decoder, cpp_wrapper=False, cache=tmp_path)
    assert third._saved == [] and torch.equal(_step_logits(decoder, third), want)


def test_a_held_tensor_that_differs_keeps_the_record_from_loading(compiled_once, tmp_path):
    decoder, first, _ = compiled_once
    [record] = saved_graphs.saved(first.cache_folder, first._constants)
    named = named_held(decoder)
    held = [row for row in record.sources if row[0] == "held"]
    with compiling_into(first.cache_folder):  # as CompiledStep loads it: the kernels the compile built
        assert held and saved_graphs.load(record, named) is not None
        name = held[0][1]
        assert saved_graphs.load(record, {**named, name: named[name].t()}) is None  # another stride
        assert saved_graphs.load(record, {k: v for k, v in named.items() if k != name}) is None  # missing


def test_a_graph_that_finds_process_objects_by_handle_is_not_saved():
    import moekit.offload.graph_store  # noqa: F401 — registers moekit::prefetch_guess

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.moekit.prefetch_guess.default, (x, 0)))
    assert saved_graphs.keeps_process_objects(torch.fx.GraphModule(torch.nn.Module(), graph))
    plain = torch.fx.Graph()
    y = plain.placeholder("y")
    plain.output(plain.call_function(torch.ops.aten.relu.default, (y,)))
    assert not saved_graphs.keeps_process_objects(torch.fx.GraphModule(torch.nn.Module(), plain))


def test_records_are_json_that_names_what_they_were_made_under(compiled_once):
    _, first, _ = compiled_once
    record = json.loads(_records(first)[0].read_text())
    assert record["constants"]["threads"] == torch.get_num_threads()
    assert record["constants"]["cpp_wrapper"] is False
    assert record["routing"] == [0, False, False]
    assert all(row[0] in ("held", "input", "size", "stride") for row in record["sources"])


def test_a_model_of_the_same_shape_with_other_constants_does_not_get_the_graph(compiled_once, tiny_checkpoints,
                                                                                tmp_path):
    decoder, first, want = compiled_once
    other = tmp_path / "other-eps"
    shutil.copytree(tiny_checkpoints("qwen3_moe"), other)
    # A paged run elsewhere in the suite may have left the store's manifest beside the shared
    # checkpoint; under the changed config.json it would be refused as another model's.
    (other / MANIFEST_NAME).unlink(missing_ok=True)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 0.25  # the same tensors; the norms' eps is a constant in the traced graph
    (other / "config.json").write_text(json.dumps(config))
    decoder2 = load_engine(other, compile=True).decoder
    second = CompiledStep(decoder2, cpp_wrapper=False, cache=tmp_path)
    assert second.cache_folder == first.cache_folder  # the key sees shapes: the records must tell them apart
    got = _step_logits(decoder2, second)
    assert second.loaded_graphs == 0
    decoder2.compiled = None
    torch.testing.assert_close(got, _step_logits(decoder2, None), rtol=0, atol=1e-4)
    assert not torch.allclose(got, want, atol=1e-3)
