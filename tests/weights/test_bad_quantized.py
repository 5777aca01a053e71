"""A quantized checkpoint that cannot be read as declared: one line naming the problem, exit 2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cli_runner import refused

pytest.importorskip("transformers")

GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
Q_B = "model.layers.0.self_attn.q_b_proj.weight"
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


def _variant(src, dst, drop=(), replace=None, quantization_config=None):
    """A copy of checkpoint `src` with tensors dropped or replaced, or another quantization_config."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    with safe_open(str(path), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys() if k not in drop}
    tensors.update(replace or {})
    save_file(tensors, str(path), metadata={"format": "pt"})
    if quantization_config is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _run(capsys, folder) -> str:
    return refused(capsys, "run", folder, "--prompt-ids", "1,2,3", "--max-new-tokens", "2")


def test_mxfp4_scales_missing(quantized_checkpoints, tmp_path, capsys):
    folder = _variant(quantized_checkpoints("mxfp4"), tmp_path / "c", drop={f"{GATE_UP}_scales"})
    assert f"MXFP4 scales {GATE_UP}_scales are missing (needed for {GATE_UP}_blocks)" in _run(capsys, folder)


def test_mxfp4_scales_of_the_wrong_shape(quantized_checkpoints, tmp_path, capsys):
    bad = torch.full((8, 128, 1), 127, dtype=torch.uint8)  # one scale per 64 instead of per 32
    folder = _variant(quantized_checkpoints("mxfp4"), tmp_path / "c", replace={f"{GATE_UP}_scales": bad})
    line = _run(capsys, folder)
    assert f"MXFP4 scales {GATE_UP}_scales are U8 [8, 128, 1], expected U8 [8, 128, 2]" in line


def test_fp8_scales_missing(quantized_checkpoints, tmp_path, capsys):
    folder = _variant(quantized_checkpoints("fp8-partial"), tmp_path / "c", drop={f"{EXPERT}_scale_inv"})
    assert f"FP8 scales {EXPERT}_scale_inv are missing (needed for {EXPERT})" in _run(capsys, folder)


def test_fp8_scales_of_the_wrong_shape(quantized_checkpoints, tmp_path, capsys):
    # q_b_proj is [2 · 40, 136]: 1 × 2 blocks of 128; floor instead of ceil would give 0 × 1.
    folder = _variant(quantized_checkpoints("fp8-partial"), tmp_path / "c", replace={f"{Q_B}_scale_inv": torch.ones(1, 1)})
    line = _run(capsys, folder)
    assert f"FP8 scales {Q_B}_scale_inv are F32 [1, 1], expected F32 [1, 2]" in line and "128×128" in line


def test_unknown_quant_method_is_named_with_the_supported_ones(quantized_checkpoints, tmp_path, capsys):
    folder = _variant(quantized_checkpoints("mxfp4"), tmp_path / "c", quantization_config={"quant_method": "awq", "bits": 4})
    assert "quant_method 'awq' is not supported (supported: mxfp4, fp8)" in _run(capsys, folder)


def test_fp8_of_another_format_is_refused(quantized_checkpoints, tmp_path, capsys):
    qc = {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}
    folder = _variant(quantized_checkpoints("fp8-partial"), tmp_path / "c", quantization_config=qc)
    assert "FP8 fmt 'e5m2' is not supported (supported: e4m3)" in _run(capsys, folder)


@pytest.mark.parametrize("kind", ["mxfp4", "fp8-partial"])
def test_a_budget_below_k_packed_experts_a_layer_is_refused_in_one_line(quantized_checkpoints, capsys, kind):
    """Paged packed experts (tests/offload/test_store_packed.py) are budgeted at their packed bytes."""
    line = refused(capsys, "run", quantized_checkpoints(kind), "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                   "--expert-memory", "10%")
    assert "--expert-memory 10% is below the minimum" in line


@pytest.mark.parametrize("kind, dtype", [("mxfp4", "mxfp4"), ("fp8-partial", "fp8")])
def test_calc_plans_with_the_format_the_checkpoint_was_published_in(quantized_checkpoints, capsys, kind, dtype):
    from cli_runner import moekit

    code, out, _ = moekit(capsys, "calc", quantized_checkpoints(kind), "--json")
    assert code == 0 and json.loads(out)["memory"]["dtype"] == dtype
    code, out, _ = moekit(capsys, "calc", quantized_checkpoints(kind), "--json", "--dtype", "bf16")
    assert json.loads(out)["memory"]["dtype"] == "bf16"


@pytest.mark.parametrize("kind, words", [("mxfp4", "MXFP4 experts"), ("fp8-partial", "stored as F8_E4M3")])
def test_pack_refuses_quantized_experts_in_one_line(quantized_checkpoints, tmp_path, capsys, kind, words):
    from cli_runner import moekit

    code, _, err = moekit(capsys, "pack", quantized_checkpoints(kind), "--out", tmp_path / "packed")
    assert code == 2 and err.strip().startswith("error: ") and "\n" not in err.strip() and words in err
