from __future__ import annotations

from pathlib import Path

import pytest

from gguf_convert import convert, tiny_checkpoint
from once_per_run import made_once
from spm_vocabulary import llama_cpp_python

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config, items):
    """Tests marked llama_cpp ask llama.cpp itself and need a python with llama-cpp-python; where
    none is found they are deselected, not skipped: the golden files they check are tested anyway."""
    needing = [item for item in items if item.get_closest_marker("llama_cpp")]
    if needing and llama_cpp_python(REPO) is None:
        config.hook.pytest_deselected(items=needing)
        items[:] = [item for item in items if not item.get_closest_marker("llama_cpp")]


@pytest.fixture(scope="session")
def converted(request, tmp_path_factory):
    """(family, outtype) → (checkpoint folder, GGUF llama.cpp's converter made of it), once a run
    (`made_once`: under xdist one worker converts, the others read its files)."""

    def get(family: str, outtype: str = "f32") -> tuple[Path, Path]:
        folder = made_once(request.config, tmp_path_factory, f"gguf-{family}", lambda f: tiny_checkpoint(family, f))
        gguf = made_once(request.config, tmp_path_factory, f"gguf-{family}-{outtype}",
                         lambda f: convert(folder, outtype, f / f"{family}-{outtype}.gguf"))
        return folder, gguf

    return get


@pytest.fixture(scope="session")
def quantized_checkpoints(tmp_path_factory):
    """kind ("mxfp4", "fp8", "fp8-partial") → a checkpoint in that published layout
    (quantized_files.py), written once per session on first use."""
    from quantized_files import FP8_PARTIAL, write_fp8, write_mxfp4

    writers = {
        "mxfp4": write_mxfp4,
        "fp8": write_fp8,
        "fp8-partial": lambda folder: write_fp8(folder, shape=FP8_PARTIAL),
    }
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = writers[kind](tmp_path_factory.mktemp(kind))
        return made[kind]

    return get
