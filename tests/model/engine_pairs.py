"""The eager and the compiled engine of one checkpoint, the pair the compiled-step tests compare."""

from __future__ import annotations

from pathlib import Path

from moekit.engine.loader import load_engine


def eager_and_compiled(folder: Path):
    """(eager engine, compiled engine) of the checkpoint in folder. The compiled one's graphs call
    their kernels from Python: a quarter of the compile time, and the same kernels (the C++ caller,
    load_engine's default, is what tests/serve/test_compiled_server.py runs)."""
    compiled = load_engine(folder, compile=True)
    compiled.decoder.compile_decode(cpp_wrapper=False)
    return load_engine(folder, compile=False), compiled
