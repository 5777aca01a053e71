"""`moekit run x.gguf` and `moekit calc x.gguf` as a user types them, and every bad GGUF refused
in one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli_runner import moekit, refused
from gguf_convert import rewrite_gguf

SUPPORTED_ARCHS = "supported: qwen3moe, qwen2moe, olmoe, gpt-oss, llama with experts (Mixtral)"


def test_calc_counts_a_gguf_as_its_checkpoint(capsys, converted):
    folder, gguf = converted("qwen3_moe", "q8_0")
    # Each plans at its stored form by default (the GGUF's tensor type, the folder's torch_dtype): the same dtype compares.
    code, from_gguf, err = moekit(capsys, "calc", gguf, "--json")
    assert code == 0 and "its GGUF tensors are" in err
    code, from_gguf, _ = moekit(capsys, "calc", gguf, "--json", "--dtype", "fp32")
    assert code == 0
    code, from_folder, _ = moekit(capsys, "calc", folder, "--json", "--dtype", "fp32")
    assert code == 0
    a, b = json.loads(from_gguf), json.loads(from_folder)
    assert a.pop("model") == gguf.stem
    b.pop("model")
    assert a == b


def test_run_a_gguf_with_activation(capsys, converted):
    _, gguf = converted("mixtral", "q8_0")
    code, out, err = moekit(capsys, "run", "--eager", gguf, "def fibonacci(n):", "--max-new-tokens", "6", "--show-activation")
    assert code == 0, err
    assert "activation per generated token" in out
    assert "GGUF mixtral" in out + err and "Q8_0 dequantized to float32 at load" in out + err


def test_run_a_gguf_by_ids_as_json(capsys, converted):
    folder, gguf = converted("olmoe", "f32")
    runs = []
    for source in (gguf, folder):
        code, out, err = moekit(capsys, "run", "--eager", source, "--prompt-ids", "1,17,42", "--max-new-tokens", "8", "--json")
        assert code == 0, err
        runs.append(json.loads(out))
    assert runs[0]["token_ids"] == runs[1]["token_ids"]


@pytest.fixture(scope="module")
def f32(converted) -> Path:
    return converted("qwen3_moe", "f32")[1]


@pytest.mark.parametrize("command", ["run", "calc"])
def test_unsupported_architecture(capsys, f32, tmp_path, command):
    other = rewrite_gguf(f32, tmp_path / "other.gguf", metadata={"general.architecture": "gemma3"})
    line = refused(capsys, command, other, *(["--prompt-ids", "1"] if command == "run" else []))
    assert "GGUF architecture 'gemma3' is not supported" in line and SUPPORTED_ARCHS in line


def test_unsupported_tensor_type(capsys, f32, tmp_path):
    """Q5_0 (22 bytes per 32 weights) on the experts' down projections, rows of 32."""
    from gguf import GGMLQuantizationType

    def q5_0(name, w):
        if "ffn_down_exps" not in name:
            return None
        return np.zeros((*w.shape[:-1], w.shape[-1] // 32 * 22), dtype=np.uint8), GGMLQuantizationType.Q5_0

    bad = rewrite_gguf(f32, tmp_path / "q5.gguf", tensor=q5_0)
    line = refused(capsys, "run", bad, "--prompt-ids", "1")
    assert "qwen3moe GGUF with tensor type Q5_0 (e.g. blk.0.ffn_down_exps.weight)" in line
    assert "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K" in line


@pytest.mark.parametrize("keep", [0.5, 0.001])  # tensor data cut, and the header itself cut
def test_truncated_gguf(capsys, f32, tmp_path, keep):
    data = f32.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    for command in (["run", cut, "--prompt-ids", "1"], ["calc", cut]):
        line = refused(capsys, *command)
        assert "truncated" in line, line


@pytest.mark.parametrize("content", [b"hello, not a model\n", b""])
def test_not_a_gguf(capsys, tmp_path, content):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(content)
    line = refused(capsys, "run", fake, "--prompt-ids", "1")
    assert "not a GGUF file" in line
