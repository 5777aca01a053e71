"""`load_any_spec(x.gguf)`: a GGUF counted from its metadata and tensor shapes, as the checkpoint it
was converted from (llama.cpp's own converter), and without importing torch; moekit.spec's own
load_spec names the function that reads it."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gguf_convert import convert, tiny_checkpoint
from moekit.errors import MoekitError
from moekit.spec import load_spec
from moekit.weights.gguf_spec import load_any_spec


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory) -> tuple[Path, Path]:
    folder = tiny_checkpoint("qwen2_moe", tmp_path_factory.mktemp("qwen2_moe"))
    return folder, convert(folder, "q8_0", folder.parent / "qwen2_moe-q8_0.gguf")


def test_gguf_spec_is_the_checkpoints(qwen2_moe):
    folder, gguf = qwen2_moe
    spec = load_any_spec(str(gguf))
    assert spec.name == gguf.stem
    assert replace(spec, name=folder.name) == load_any_spec(str(folder)) == load_spec(str(folder))
    with pytest.raises(MoekitError, match="a GGUF file, whose config moekit.weights.gguf_spec.load_any_spec reads"):
        load_spec(str(gguf))  # spec reads no GGUF header: it sits below weights


_PROBE = """
import sys
from moekit.calc.params import count_params
from moekit.weights.gguf_spec import load_any_spec
print(count_params(load_any_spec(sys.argv[1])).total_params)
print(sorted(m for m in ("torch", "transformers", "safetensors") if m in sys.modules))
"""


def test_gguf_spec_never_imports_torch(qwen2_moe):
    from moekit.calc.params import count_params

    folder, gguf = qwen2_moe
    out = subprocess.run([sys.executable, "-c", _PROBE, str(gguf)], capture_output=True, text=True, check=True)
    total, imported = out.stdout.split("\n")[:2]
    assert int(total) == count_params(load_spec(str(folder))).total_params
    assert imported == "[]"


def test_a_text_file_named_gguf_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text('{"model_type": "qwen3_moe"}')
    with pytest.raises(MoekitError, match="not a GGUF file"):
        load_any_spec(str(fake))
