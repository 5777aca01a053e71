"""`moekit bench make-checkpoint` on tiny shapes: what it writes loads in moekit, transformers and
gguf-py, holds the parameters `moekit calc` counts, and gpt-oss's forms hold the same weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cli_runner import moekit, refused
from moekit.bench.make_checkpoint import make_checkpoint
from moekit.calc.params import count_params
from moekit.engine.loader import load_engine
from moekit.weights.gguf_spec import load_any_spec

QWEN = dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)
GPT_OSS = dict(model_type="gpt_oss", vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
               sliding_window=8, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
PROMPT = "hello world"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Every format of both families, written once for the module: (family, format) → path."""
    root = tmp_path_factory.mktemp("made")
    out = {}
    for family, config, formats in (("qwen", QWEN, ("safetensors-bf16", "gguf-q8_0")),
                                    ("gpt_oss", GPT_OSS, ("safetensors-bf16", "mxfp4", "gguf-mxfp4"))):
        for fmt in formats:
            path = root / (f"{family}-{fmt}" + (".gguf" if fmt.startswith("gguf") else ""))
            out[family, fmt] = make_checkpoint(config, fmt, path, seed=3).path
    return out


def _calc_total(config: dict) -> int:
    from moekit.spec.loading import spec_from_config

    return count_params(spec_from_config(config, "tiny")).total_params


@pytest.mark.parametrize("family, fmt", [("qwen", "safetensors-bf16"), ("qwen", "gguf-q8_0"),
                                         ("gpt_oss", "safetensors-bf16"), ("gpt_oss", "mxfp4")])
def test_moekit_loads_each_form_with_the_parameters_calc_counts(written, family, fmt):
    config = QWEN if family == "qwen" else GPT_OSS
    path = written[family, fmt]
    assert count_params(load_any_spec(str(path))).total_params == _calc_total(config)
    engine = load_engine(path, compile=False)
    gen = engine.generate([engine.tokenizer.encode(PROMPT).ids], max_new_tokens=3, stop_ids=())
    assert len(gen.token_ids[0]) == 3


def test_the_gguf_files_hold_calcs_parameters_by_gguf_py(written):
    from gguf import GGUFReader

    for (family, fmt), path in written.items():
        if fmt.startswith("gguf"):
            reader = GGUFReader(path)
            elements = sum(int(np.prod(t.shape)) for t in reader.tensors)
            assert elements == _calc_total(QWEN if family == "qwen" else GPT_OSS), (family, fmt)


def test_transformers_loads_the_safetensors_forms_and_generates_as_moekit(written):
    from transformers import AutoModelForCausalLM

    for family in ("qwen", "gpt_oss"):
        path = written[family, "safetensors-bf16"]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        engine = load_engine(path, compile=False)
        ids = engine.tokenizer.encode(PROMPT).ids
        ref = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
        assert engine.generate([ids], max_new_tokens=4, stop_ids=()).token_ids[0] == ref, family


def test_gpt_oss_mxfp4_and_bf16_forms_of_one_seed_generate_the_same_tokens(written):
    mx, bf = load_engine(written["gpt_oss", "mxfp4"], compile=False), load_engine(written["gpt_oss", "safetensors-bf16"], compile=False)
    ids = bf.tokenizer.encode(PROMPT).ids
    assert (mx.generate([ids], max_new_tokens=5, stop_ids=()).token_ids
            == bf.generate([ids], max_new_tokens=5, stop_ids=()).token_ids)


def test_gpt_oss_gguf_experts_are_the_published_experts_in_llama_cpps_layout(written):
    """gguf-py's MXFP4 dequantization of ffn_gate/up/down_exps equals the bf16 form's interleaved
    gate_up_proj (even / odd columns) and down_proj, transposed to llama.cpp's [E, out, in]."""
    from gguf import GGUFReader, GGMLQuantizationType, quants
    from safetensors import safe_open

    reader = GGUFReader(written["gpt_oss", "gguf-mxfp4"])
    tensors = {t.name: t for t in reader.tensors}
    folder = written["gpt_oss", "safetensors-bf16"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]

    def hub(name):
        with safe_open(folder / index[name], "pt") as f:
            return f.get_tensor(name).float()

    gate_up, down = hub("model.layers.1.mlp.experts.gate_up_proj"), hub("model.layers.1.mlp.experts.down_proj")
    for name, want in (("gate", gate_up[..., 0::2]), ("up", gate_up[..., 1::2]), ("down", down)):
        t = tensors[f"blk.1.ffn_{name}_exps.weight"]
        assert t.tensor_type == GGMLQuantizationType.MXFP4
        got = quants.dequantize(np.asarray(t.data), GGMLQuantizationType.MXFP4)
        assert torch.equal(torch.from_numpy(np.ascontiguousarray(got)), want.transpose(1, 2)), name
    bias = torch.from_numpy(np.asarray(tensors["blk.1.ffn_up_exps.bias"].data).copy())
    assert torch.equal(bias, hub("model.layers.1.mlp.experts.gate_up_proj_bias")[:, 1::2])


def test_the_command_writes_a_preset_shape_and_refuses_what_it_cannot_write(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN))
    code, out, _ = moekit(capsys, "bench", "make-checkpoint", "--shape", config, "--format", "gguf-q8_0",
                          "--out", tmp_path / "q.gguf", "--no-progress")
    assert code == 0 and "parameters" in out and (tmp_path / "q.gguf").is_file()
    assert "formats are" in refused(capsys, "bench", "make-checkpoint", "--shape", config, "--format", "fp3",
                                    "--out", tmp_path / "x")
    assert "gpt-oss's form" in refused(capsys, "bench", "make-checkpoint", "--shape", config, "--format", "mxfp4",
                                       "--out", tmp_path / "y")
    assert "no such preset" in refused(capsys, "bench", "make-checkpoint", "--shape", "nope-7b", "--format",
                                       "mxfp4", "--out", tmp_path / "z")
    assert "*.gguf" in refused(capsys, "bench", "make-checkpoint", "--shape", config, "--format", "gguf-q8_0",
                               "--out", tmp_path / "q.bin")
