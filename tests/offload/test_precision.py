"""Experts packed at int8 / int4 / by profile, paged by the store: exact against the resident int8
and bf16 engines, their real bytes in the budget and the meter, corrupted blocks refused, and a
profile of another model refused with one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cli_runner import moekit, refused
from hf_tiny import write_checkpoint
from offload_files import flip_byte, write_tiny
from moekit.engine.loader import load_engine
from moekit.errors import ExpertIntegrityError
from moekit.model.linear import INT4, INT8, INT8_GEMV
from moekit.weights.manifest import read_manifest
from moekit.offload.options import OffloadOptions
from moekit.offload.pack import pack_experts
from moekit.offload.pins import model_identity, profile_document
from moekit.offload.precision import by_frequency, stored_kind, uniform, weight_bytes
from moekit.analysis.profile import count_experts
from moekit.spec import load_spec

PROMPTS = [[1, 17, 42, 99, 5, 63], [3, 4, 5, 6, 7, 8, 9, 10]]  # two rows: grouped and one-token paths
NEW = 12


def _tokens(engine) -> list[list[int]]:
    try:
        return engine.generate(PROMPTS, max_new_tokens=NEW, stop_ids=()).token_ids
    finally:
        engine.close()


def _least(folder) -> OffloadOptions:
    """The smallest budget allowed: K experts per layer, so almost every use is a miss."""
    config = json.loads((folder / "config.json").read_text())
    n = config.get("num_local_experts") or config.get("num_experts")
    return OffloadOptions(f"{100 * config['num_experts_per_tok'] / n + 0.01:.2f}%")


def _pack(folder, dest, precision: str):
    return pack_experts(folder, dest, precisions=uniform(load_spec(str(folder)), precision)).folder


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen"), seed=2)


# One family per Hub layout (per-expert tensors, stacked rows, gpt_oss's interleaved transposes with biases).
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "granitemoe", "gpt_oss"])
def test_paged_int8_is_token_for_token_the_resident_int8(family, tmp_path):
    folder = write_checkpoint(family, tmp_path / family, seed=2)
    packed = _pack(folder, tmp_path / "int8", "int8")
    want = _tokens(load_engine(folder, weights="int8-experts", compile=False))  # fp32 activations
    paged = load_engine(packed, offload=_least(folder), compile=False)
    assert paged.store.slots < paged.spec.layers[0].ffn.num_experts and paged.store.precision.endswith("int8")
    experts = paged.decoder.layers[0].ffn.experts
    assert all(k in (INT8, INT8_GEMV) for k in experts.kernels) and experts.form.expert_kernels is None
    assert _tokens(paged) == want


def test_int8_at_load_from_a_float_checkpoint_pages_too(qwen):
    want = _tokens(load_engine(qwen, weights="int8-experts", compile=False))
    engine = load_engine(qwen, weights="int8-experts", offload=_least(qwen), compile=False)
    assert engine.store is not None and "int8" in engine.store.precision
    assert _tokens(engine) == want


def test_packed_bf16_is_the_resident_bf16_engine(qwen, tmp_path):
    packed = _pack(qwen, tmp_path / "bf16", "bf16")  # the fp32 checkpoint cast as loading casts it
    want = _tokens(load_engine(qwen, dtype="bfloat16", compile=False))
    assert _tokens(load_engine(packed, dtype="bfloat16", offload=_least(qwen), compile=False)) == want


def test_a_bf16_checkpoint_packed_bf16_is_its_own_bytes(tmp_path):
    folder = write_tiny("qwen3_moe", tmp_path / "ckpt", dtype=torch.bfloat16)
    plain = pack_experts(folder, tmp_path / "plain").path.read_bytes()
    cast = _pack(folder, tmp_path / "bf16", "bf16").joinpath("experts.packed.safetensors").read_bytes()
    data = lambda raw: raw[8 + int.from_bytes(raw[:8], "little") :]  # after the header (its metadata differs)
    assert data(cast) == data(plain)
    want = _tokens(load_engine(folder, dtype="bfloat16", compile=False))
    assert _tokens(load_engine(tmp_path / "bf16", dtype="bfloat16", offload=_least(folder), compile=False)) == want


def test_int8_blocks_are_34_bytes_per_32_weights_in_the_file_the_budget_and_the_meter(qwen, tmp_path):
    spec = load_spec(str(qwen))
    packed = _pack(qwen, tmp_path / "int8", "int8")
    manifest = read_manifest(packed)
    d, f = spec.hidden_size, spec.layers[0].ffn.expert.width
    each = weight_bytes("Q8_0", (2 * f, d)) + weight_bytes("Q8_0", (d, f))
    assert each == 2 * f * math.ceil(d / 32) * 34 + d * math.ceil(f / 32) * 34
    assert all(stored_kind(ex) == "Q8_0" and ex.nbytes == each for ex in manifest.experts.values())

    engine = load_engine(packed, offload=OffloadOptions("50%"), compile=False)
    gen = engine.generate(PROMPTS, max_new_tokens=NEW, stop_ids=())
    stats = engine.store.stats()
    total = each * len(manifest.experts)
    assert stats["expert_bytes"] == each and stats["slots_per_layer"] == (total // 2) // (each * len(spec.moe_layers))
    assert 0 < stats["peak_resident_expert_bytes"] <= stats["budget_bytes"] <= total // 2
    assert stats["disk_bytes"] == stats["loads"] * each
    fp32 = 4 * (3 * f * d)  # the same expert's params at the engine's fp32
    for token in engine.meter(gen):
        distinct = sum(len(set(ids)) for ids in token.experts.values())
        assert token.bytes_touched == token.params_touched * 4 - distinct * (fp32 - each)
    engine.close()


def test_a_packed_int8_checkpoint_runs_its_packed_experts_without_a_budget(qwen, tmp_path):
    packed = _pack(qwen, tmp_path / "int8", "int8")
    engine = load_engine(packed, compile=False)  # no --expert-memory: the store, every expert resident
    assert engine.store is not None and engine.store.slots == engine.spec.layers[0].ffn.num_experts
    assert _tokens(engine) == _tokens(load_engine(qwen, weights="int8-experts", compile=False))


def _profile(folder, path):
    engine = load_engine(folder, compile=False)
    counts, _ = count_experts(engine, PROMPTS, max_new_tokens=8)
    path.write_text(json.dumps(profile_document(model_identity(folder, engine.spec), counts, 2, workload={})))
    return counts


def test_hot_experts_keep_bf16_and_cold_ones_run_int4_each_with_its_own_kernels_and_bytes(qwen, tmp_path):
    counts = _profile(qwen, tmp_path / "profile.json")
    spec = load_spec(str(qwen))
    precisions = by_frequency(counts, "bf16", "int4", 0.25)
    assert sum(p == "bf16" for p in precisions.values()) == 2 * len(spec.moe_layers)  # 25% of 8, per layer
    result = pack_experts(qwen, tmp_path / "mixed", precisions=precisions)
    assert result.precision == "4 bf16 + 12 int4"
    manifest = read_manifest(result.folder)
    assert all(stored_kind(manifest.experts[k]) == (None if p == "bf16" else "Q4_0") for k, p in precisions.items())

    full = load_engine(result.folder, dtype="bfloat16", compile=False)
    experts = full.decoder.layers[0].ffn.experts
    assert {k for pair in experts.form.expert_kernels for k in pair} >= {INT4}
    d, f = spec.hidden_size, spec.layers[0].ffn.expert.width
    for (layer, e), p in precisions.items():
        bf16 = 2 * 3 * f * d
        int4 = weight_bytes("Q4_0", (2 * f, d)) + weight_bytes("Q4_0", (d, f))
        assert full.store.expert_nbytes(layer, e) == (bf16 if p == "bf16" else int4)
    total = sum(full.store.expert_nbytes(*key) for key in precisions)
    assert full.store.stats()["budget_bytes"] == total  # every expert at its own bytes, not 16 bf16 slots
    want = _tokens(full)
    # A slot holds the largest expert, so no mix of resident experts passes the budget: K bf16 experts a layer.
    least = 2 * (2 * 3 * f * d) * len(spec.moe_layers)
    paged = load_engine(result.folder, dtype="bfloat16", offload=OffloadOptions(str(least)), compile=False)
    assert paged.store.expert_bytes == 2 * 3 * f * d and paged.store.slots == 2
    assert _tokens(paged) == want


def test_a_flipped_byte_in_a_packed_int4_expert_is_refused_naming_it(qwen, tmp_path):
    packed = _pack(qwen, tmp_path / "int4", "int4")
    engine = load_engine(packed, compile=False)
    gen = engine.generate(PROMPTS[:1], max_new_tokens=1, stop_ids=())
    engine.close()
    layer = engine.spec.moe_layers[-1]
    e = int(gen.routing[0].layers[-1].topk_ids[0, 0])  # an expert the prompt's first token uses
    x = read_manifest(packed).experts[layer, e].gate_up[0]
    assert x.dtype == "Q4_0"
    flip_byte(packed / x.file, x.offset + 5)
    engine = load_engine(packed, compile=False)
    with pytest.raises(ExpertIntegrityError, match=f"layer {layer} expert {e}: checksum mismatch"):
        engine.generate(PROMPTS[:1], max_new_tokens=1, stop_ids=())
    engine.close()


def test_cli_packs_by_profile_and_says_the_split(qwen, tmp_path, capsys):
    _profile(qwen, tmp_path / "profile.json")
    code, out, err = moekit(capsys, "pack", qwen, "--precision-by-profile", tmp_path / "profile.json", "--hot", "bf16",
                            "--cold", "int4", "--hot-share", "25%", "--out", tmp_path / "mixed")
    assert code == 0, err
    assert "4 bf16 + 12 int4" in out


def test_cli_refuses_a_profile_of_another_model_in_one_line(qwen, tmp_path, capsys):
    other = write_checkpoint("qwen3_moe", tmp_path / "other", seed=1, num_experts=16)
    doc = profile_document(model_identity(other, load_spec(other)), {0: [1] * 16, 1: [1] * 16}, top=2, workload={})
    (tmp_path / "p.json").write_text(json.dumps(doc))
    line = refused(capsys, "pack", qwen, "--precision-by-profile", tmp_path / "p.json", "--cold", "int4",
                   "--out", tmp_path / "out")
    assert "made for another model" in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args", [["--precision", "int3"], ["--precision-by-profile", "p.json", "--hot-share", "150%"],
                                  ["--precision", "int8", "--precision-by-profile", "p.json"]])
def test_cli_refuses_bad_precision_options_in_one_line(qwen, tmp_path, capsys, args):
    _profile(qwen, tmp_path / "p.json")
    args = [str(tmp_path / a) if a == "p.json" else a for a in args]
    refused(capsys, "pack", qwen, *args, "--out", tmp_path / "out")


@pytest.mark.parametrize("option", [["--hot", "bf16"], ["--cold", "int4"], ["--hot-share", "50%"]])
def test_profile_options_without_a_profile_are_refused_not_ignored(qwen, tmp_path, capsys, option):
    err = refused(capsys, "pack", qwen, *option, "--out", tmp_path / "out")
    assert "give --precision-by-profile too" in err
    assert not (tmp_path / "out").exists()


def test_hot_experts_are_each_layers_most_used_ties_to_the_lower_id_and_unused_ones_stay_cold():
    counts = {0: [5, 0, 9, 5, 1, 0, 0, 0], 3: [0] * 8}
    split = by_frequency(counts, "bf16", "int4", 0.375)  # 3 of 8 per layer
    assert [e for e in range(8) if split[0, e] == "bf16"] == [0, 2, 3]
    assert all(split[3, e] == "int4" for e in range(8))  # a layer the profile never saw: all cold


def test_block_bytes_count_the_padded_last_block():
    assert weight_bytes("Q8_0", (10, 64)) == 10 * 2 * 34
    assert weight_bytes("Q8_0", (10, 52)) == 10 * 2 * 34  # 52 inputs: a second block, zero padded
    assert weight_bytes("Q4_0", (10, 224)) == 10 * 7 * 18
    assert weight_bytes("BF16", (10, 52)) == 10 * 52 * 2
