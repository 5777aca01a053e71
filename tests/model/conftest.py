"""tests/model: a cold compile that two modules start from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class ColdCompile:
    """tiny qwen3_moe's batch-1 step (the Python caller) compiled into an empty folder, once."""

    decoder: object  # moekit.model.decoder.Decoder, compiled=True
    root: Path  # the cache the step compiled under (its key's folder below it)
    step: object  # the CompiledStep that compiled
    said: list  # its warm-up's lines
    written: list  # every file the compile wrote under root: its graphs and the kernels beside them (test_compile_cache._generated)
    logits: object  # its logits on test_compile_cache._step_logits' steps


@pytest.fixture(scope="session")
def qwen3_compiled_cold(tiny_checkpoints, tmp_path_factory) -> ColdCompile:
    """One cold compile for tests/model/test_compile_cache.py (a second step loads what it wrote) and
    tests/model/test_saved_graphs.py (later steps load, or pass over, the graph it saved), instead
    of one each: the same decoder, options and graph. Their tests only read this folder (the second
    step's must write nothing: test_compile_cache checks it) or write into copies of it."""
    from test_compile_cache import _generated, _step_logits

    from moekit.engine.loader import load_engine
    from moekit.model.compiled_step import CompiledStep

    decoder = load_engine(tiny_checkpoints("qwen3_moe"), compile=True).decoder
    root = tmp_path_factory.mktemp("compiled-cold")
    said: list = []
    step = CompiledStep(decoder, cpp_wrapper=False, cache=root)
    step.warm_up((1,), say=said.append)
    written = _generated(root)
    return ColdCompile(decoder, root, step, said, written, _step_logits(decoder, step))
