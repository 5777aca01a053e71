"""Experts a checkpoint publishes packed, paged by the expert store: gpt_oss's MXFP4 and DeepSeek-V3's
block-scaled FP8 stay packed on disk, in a slot and in the kernels. A paged run generates the resident
packed engine's tokens exactly, a slot and a miss cost the packed bytes (4.25 / 8.25 bits a weight),
and a flipped byte in a packed expert is the store's one-line integrity error."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from cli_runner import moekit, refused
from moekit import load as moekit_load  # the Python API (`moekit` is the CLI runner here)
from moekit.engine.loader import load_engine
from moekit.errors import CheckpointError, ExpertIntegrityError
from moekit.weights.manifest import load_or_build_manifest, read_manifest
from moekit.offload.options import OffloadOptions
from moekit.offload.reader import ExpertReader
from moekit.spec import load_spec
from offload_files import PROMPTS, flip_byte, greedy_runs
from tests.weights.quantized_files import FP8_PARTIAL, write_fp8, write_mxfp4

NEW = 12
RUN = ["--prompt-ids", "5,17,42,9,77", "--max-new-tokens", "8", "--stop", "", "--json"]
WRITERS = {"mxfp4": write_mxfp4, "fp8": write_fp8, "fp8-partial": lambda folder: write_fp8(folder, shape=FP8_PARTIAL)}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """kind → a tiny checkpoint in that published layout, written once per module."""
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = WRITERS[kind](tmp_path_factory.mktemp(kind))
        return made[kind]

    return get


def _generate(folder, offload=None, dtype="float32"):
    """(one prompt at a time, the batch, the store's stats) of a greedy run."""
    return greedy_runs(folder, offload, dtype, new=NEW)


def _prepared_bytes(spec, kind: str, block_in: int = 128) -> int:
    """One expert as moekit.ops.packed_layout's prepared rows, from the format's definition: MXFP4 17
    bytes per 32 inputs; FP8 a byte per weight plus an fp32 scale per row and column block."""
    moe = spec.layers[spec.moe_layers[0]].ffn
    d, f = moe.expert.hidden_size, moe.expert.width
    weights = [(2 * f, d), (d, f)]  # gate_up [2F, D], down [D, F]
    if kind == "mxfp4":
        return sum(out * inp // 32 * 17 for out, inp in weights)
    return sum(out * (inp + 4 * math.ceil(inp / block_in)) for out, inp in weights)


@pytest.mark.parametrize("kind", ["mxfp4", "fp8", "fp8-partial"])
def test_paged_tokens_are_the_resident_packed_tokens(published, kind):
    folder = published(kind)
    want = _generate(folder)[:2]
    for options in (OffloadOptions("25%"), OffloadOptions("25%", policy="none"), OffloadOptions("50%", prefetch=True)):
        single, batch, stats = _generate(folder, options)
        assert (single, batch) == want, options
        assert stats["loads"] > 0 and stats["hit_rate"] < 1  # experts were read, and some read again
    assert read_manifest(folder).experts  # the first paged run wrote the store's manifest, the others read it


def test_bfloat16_paged_mxfp4_is_the_resident_bfloat16_run(published):
    folder = published("mxfp4")
    assert _generate(folder, OffloadOptions("25%"), dtype="bfloat16")[:2] == _generate(folder, dtype="bfloat16")[:2]


@pytest.mark.parametrize("kind", ["mxfp4", "fp8"])
def test_paged_packed_experts_run_through_the_compiled_step_with_the_eager_reads(published, kind):
    """The store's op (moekit.offload.graph_store) runs the packed experts' kernels as the eager step
    does; the rest of the step (gpt_oss's sinks, DeepSeek's latent attention) is compiled."""
    runs = []
    for compile in (False, True):
        engine = load_engine(published(kind), offload=OffloadOptions("50%", prefetch=True), compile=compile)
        try:
            assert (engine.decoder.compiled is not None) == compile, engine.notes
            tokens = [engine.generate(p, max_new_tokens=NEW, stop_ids=()).token_ids[0] for p in PROMPTS]
            stats = engine.store.stats()
            runs.append((tokens, {k: stats[k] for k in ("accesses", "loads", "disk_bytes", "prefetch_recall")}))
        finally:
            engine.close()
    assert runs[1] == runs[0] and runs[0][1]["loads"] > 0


@pytest.mark.parametrize("kind", ["mxfp4", "fp8", "fp8-partial"])
def test_an_expert_read_by_the_store_is_the_resident_packed_expert_byte_for_byte(published, kind):
    folder = published(kind)
    resident = load_engine(folder, compile=False)
    spec = resident.spec
    manifest = load_or_build_manifest(folder, spec)
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    block = tuple(quantization["weight_block_size"]) if kind != "mxfp4" else None  # FP8 rows need it
    with ExpertReader(folder, manifest, torch.float32, fp8_block=block) as reader:
        for layer in spec.moe_layers:
            experts = resident.decoder.layers[layer].ffn.experts
            assert experts.kept_packed
            for e in range(experts.num_experts):
                for got, want in zip(reader.read(layer, e), experts.resident_weights(e)):
                    assert got.dtype == want.dtype == torch.uint8 and torch.equal(got, want), (layer, e)


@pytest.mark.parametrize("kind, bits", [("mxfp4", 4.25), ("fp8", 8.25)])
def test_a_slot_a_miss_and_the_meter_cost_the_packed_bytes(published, kind, bits):
    folder = published(kind)
    spec = load_spec(str(folder))
    each = _prepared_bytes(spec, kind)
    expert = spec.layers[spec.moe_layers[0]].ffn.expert
    d, f = expert.hidden_size, expert.width
    assert each * 8 / (3 * d * f) == pytest.approx(bits)  # these shapes are whole blocks

    resident = moekit_load(folder, compile=False)
    held = sum(w.numel() for w in resident.decoder.layers[spec.moe_layers[0]].ffn.experts.resident_weights(0))
    assert held == each  # a slot holds what a resident packed expert holds
    engine = moekit_load(folder, expert_memory="25%", policy="none", compile=False)
    try:
        gen = engine.generate(PROMPTS[0], max_new_tokens=4, stop_ids=())
        stats = engine.store.stats()
        on_disk = read_manifest(folder).experts[spec.moe_layers[0], 0].nbytes
        assert stats["expert_bytes"] == each
        assert stats["disk_bytes"] == stats["loads"] * on_disk  # every expert of a checkpoint alike
        assert stats["peak_resident_expert_bytes"] == engine.store.clock.peak_resident_experts * each
        assert stats["peak_resident_expert_bytes"] <= stats["budget_bytes"]
        assert {engine.expert_bytes(layer, e) for layer in spec.moe_layers for e in range(8)} == {each}
        assert all(t.share > 0 for t in engine.meter(gen))
    finally:
        engine.close()
    if kind == "mxfp4":
        assert on_disk == each  # the prepared rows are the published bytes, scale beside codes
    else:
        grid = [math.ceil(out / 128) * math.ceil(inp / 128) for out, inp in ((f, d), (f, d), (d, f))]
        assert on_disk == 3 * d * f + 4 * sum(grid)  # a byte a code, and the file's one fp32 scale per block


def test_the_cli_pages_packed_experts_and_reports_their_bytes(capsys, published):
    folder = published("mxfp4")
    code, out, err = moekit(capsys, "run", "--eager", folder, *RUN)
    assert code == 0, err
    want = json.loads(out)["token_ids"]
    code, out, err = moekit(capsys, "run", "--eager", folder, *RUN, "--expert-memory", "25%")
    assert code == 0, err
    got = json.loads(out)
    assert got["token_ids"] == want
    each = _prepared_bytes(load_spec(str(folder)), "mxfp4")
    prefill = got["offload"]["prefill"]
    assert got["offload"]["expert_bytes"] == each and prefill["disk_bytes"] == prefill["loads"] * each > 0
    assert "note:" not in err  # experts paged in the format the checkpoint publishes: nothing to announce


@pytest.mark.parametrize("kind, part", [("mxfp4", "scales of gate_up"), ("mxfp4", "blocks of down"), ("fp8", "scale_inv of down")])
def test_a_flipped_byte_in_a_packed_expert_is_one_line_exit_2(capsys, published, tmp_path, kind, part):
    folder = shutil.copytree(published(kind), tmp_path / "damaged")
    spec = load_spec(str(folder))
    code, out, err = moekit(capsys, "run", "--eager", folder, *RUN)
    assert code == 0, err
    layer = spec.moe_layers[-1]
    expert = json.loads(out)["activation"][0]["experts"][str(layer)][0]  # the prefill routes to it
    ex = load_or_build_manifest(folder, spec).experts[layer, expert]
    extent = {"scales of gate_up": ex.gate_up[1], "blocks of down": ex.down[0], "scale_inv of down": ex.down[1]}[part]
    flip_byte(folder / extent.file, extent.offset + extent.length // 2)

    err = refused(capsys, "run", "--eager", folder, *RUN, "--expert-memory", "25%", "--cache", "none")
    assert "Traceback" not in err
    assert f"layer {layer} expert {expert}: checksum mismatch in {extent.file}" in err
    with pytest.raises(ExpertIntegrityError):
        _generate(folder, OffloadOptions("25%"))
    # The resident load checks the same extents as it reads the packed tensors.
    with pytest.raises(CheckpointError) as resident:
        load_engine(folder, compile=False)
    assert f"layer {layer} expert {expert}" in str(resident.value) and "checksum mismatch" in str(resident.value)


def test_moekit_pack_refuses_published_packed_experts_in_one_line(capsys, published, tmp_path):
    code, out, err = moekit(capsys, "pack", published("mxfp4"), "--out", tmp_path / "packed")
    line = err.strip()  # (pack's progress line leaves a newline before it)
    assert code == 2 and out == "" and line.startswith("error: ") and "\n" not in line
    assert "MXFP4 experts (stored as U8" in line and "paged as published" in line
