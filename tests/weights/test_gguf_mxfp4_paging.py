"""`moekit run oss.gguf --expert-memory`: the expert store pages a gpt-oss GGUF's MXFP4 experts from the
file, each expert's slices of blk.N.ffn_{gate,up,down}_exps read into the packed kernels' prepared rows
(moekit.weights.gguf_extents, layout "gguf_mxfp4"), and generates the resident tokens exactly.
The GGUF is make_checkpoint's gguf-mxfp4 (llama.cpp's converter's layout) of a tiny gpt_oss."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cli_runner import moekit, refused
from offload_files import PROMPTS, flip_byte, greedy_runs

from moekit.bench.make_checkpoint import make_checkpoint
from moekit.engine.loader import load_engine
from moekit.offload.options import OffloadOptions
from moekit.offload.policies import LIVE_POLICIES
from moekit.offload.reader import ExpertReader
from moekit.weights.gguf_extents import manifest_path, store_manifest
from moekit.weights.gguf_file import read_gguf

GPT_OSS = dict(model_type="gpt_oss", vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
               sliding_window=4, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
SMALL = "25%"  # 2 of 8 experts a layer, top-2: most uses miss
NEW = 12
RUN = ["--prompt-ids", "5,17,42,9,77,3,101", "--max-new-tokens", "8", "--stop", "", "--json"]
D, F, E = GPT_OSS["hidden_size"], GPT_OSS["intermediate_size"], GPT_OSS["num_local_experts"]
EXPERT_BYTES = (2 * F * D // 32 + D * F // 32) * 17  # prepared rows: 17 bytes per 32 weights


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    return make_checkpoint(GPT_OSS, "gguf-mxfp4", tmp_path_factory.mktemp("oss_paged") / "oss.gguf", seed=11).path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_tokens_are_the_resident_tokens_under_every_policy(gguf, dtype):
    """One prompt at a time and a left-padded batch, with every cache policy, none, prefetch, read-ahead
    and O_DIRECT: the resident engine's greedy tokens."""
    want = greedy_runs(gguf, None, dtype, new=NEW)[:2]
    options = [OffloadOptions(SMALL, policy=p) for p in (*LIVE_POLICIES, "none")]
    options += [OffloadOptions("50%", prefetch=True), OffloadOptions(SMALL, read_ahead=3, direct_io=True)]
    for option in options:
        single, batch, stats = greedy_runs(gguf, option, dtype, new=NEW)
        assert (single, batch) == want, option
        assert stats["loads"] > 0 and stats["hit_rate"] < 1, option  # experts were read, and some again
        assert stats["expert_precision"] == f"{2 * E} mxfp4"


def test_a_slot_and_a_miss_cost_the_stored_mxfp4_bytes(gguf):
    engine = load_engine(gguf, offload=OffloadOptions(SMALL, policy="none"), compile=False)
    try:
        engine.generate(PROMPTS[0], max_new_tokens=4, stop_ids=())
        stats = engine.store.stats()
    finally:
        engine.close()
    stacked = [t for t in read_gguf(gguf).tensors.values() if t.name.endswith("_exps.weight")]
    assert {t.qtype for t in stacked} == {"MXFP4"}
    assert sum(t.n_bytes for t in stacked) == 2 * E * EXPERT_BYTES  # the file's bytes are the prepared rows'
    assert stats["expert_bytes"] == EXPERT_BYTES  # 4.25 bits a weight held, as resident
    assert stats["disk_bytes"] == stats["loads"] * EXPERT_BYTES  # and read: nothing but the expert's slices
    assert stats["peak_resident_expert_bytes"] <= stats["budget_bytes"]


def test_a_miss_reads_into_an_evicted_experts_memory(gguf):
    """Each layer's slots are carved once (moekit.offload.attach.mxfp4_slots); after many misses each
    slot is still held, by an expert read into it or as a spare, and at most K experts beyond them (a
    prompt wider than the slots): misses read into evicted experts' memory. The tokens are the
    resident ones (test above), so no expert was overwritten while in use."""
    engine = load_engine(gguf, offload=OffloadOptions(SMALL, read_ahead=2), compile=False)
    try:
        for prompt in PROMPTS:
            engine.generate(prompt, max_new_tokens=NEW, stop_ids=())
        assert engine.store.stats()["loads"] > 4 * 2 * len(engine.store.layers)
        for store in engine.store.layers.values():
            held = [w[0].data_ptr() for w in store._spare] + [f.result()[0].data_ptr() for f in store._weights.values()]
            assert len(store._slot_ptrs) == 2 and store._slot_ptrs <= set(held), store.layer
            assert len(held) <= 2 + GPT_OSS["num_experts_per_tok"], store.layer
    finally:
        engine.close()


def test_an_expert_read_by_the_store_is_the_resident_prepared_rows_byte_for_byte(gguf):
    """Read twice, and through O_DIRECT: the nibbles are reordered in a buffer of the read's own, so a
    later read of the same expert starts again from the file's bytes."""
    resident = load_engine(gguf, compile=False)
    spec = resident.spec
    manifest, _ = store_manifest(read_gguf(gguf), spec, verify=False)
    assert {ex.layout for ex in manifest.experts.values()} == {"gguf_mxfp4"}
    for direct in (False, True):
        with ExpertReader(gguf, manifest, torch.float32, direct=direct) as reader:
            for layer in spec.moe_layers:
                experts = resident.decoder.layers[layer].ffn.experts
                assert experts.kept_packed
                for e in (*range(E), 0, E - 1):
                    for got, want in zip(reader.read(layer, e), experts.resident_weights(e)):
                        assert got.dtype == want.dtype == torch.uint8 and torch.equal(got, want), (layer, e, direct)


def test_a_budget_of_every_expert_runs_the_resident_packed_load(gguf):
    engine = load_engine(gguf, offload=OffloadOptions("100%"), compile=False)
    try:
        assert engine.store is None and any("running fully resident" in n for n in engine.notes), engine.notes
    finally:
        engine.close()


def _tokens(capsys, *args) -> tuple[list[int], str]:
    code, out, err = moekit(capsys, "run", *args, *RUN)
    assert code == 0, err
    return json.loads(out)["token_ids"], err


def test_the_compiled_default_and_eager_paged_runs_give_the_resident_tokens(capsys, gguf):
    want, _ = _tokens(capsys, "--eager", gguf)
    for eager in (["--eager"], []):
        got, err = _tokens(capsys, *eager, gguf, "--expert-memory", SMALL)
        assert got == want, (eager, err)
        assert ("run as one compiled graph" in err) != bool(eager), err


def _routed_in_layer_0(gguf: Path) -> int:
    """An expert the prompt's first token uses in layer 0 (every run below reads it)."""
    prompt = [int(i) for i in RUN[1].split(",")]
    gen = load_engine(gguf, compile=False).generate([prompt], max_new_tokens=1, stop_ids=())
    (layer0,) = [r for r in gen.routing[0].layers if r.layer == 0]
    return int(layer0.topk_ids[0, 0])


def test_checksum_covers_each_expert_and_a_flipped_byte_is_one_line(capsys, gguf, tmp_path):
    copy = shutil.copy(gguf, tmp_path / "oss.gguf")
    want, _ = _tokens(capsys, "--eager", copy)
    code, out, err = moekit(capsys, "checksum", copy)
    assert code == 0 and out.startswith(f"wrote {manifest_path(copy)}: {2 * E} routed experts and "), (out, err)
    assert "whole tensors only" not in err
    for paged in ([], ["--expert-memory", SMALL]):
        got, err = _tokens(capsys, "--eager", copy, *paged)
        assert got == want and "unverified" not in err

    e = _routed_in_layer_0(copy)
    t = read_gguf(copy).tensors["blk.0.ffn_up_exps.weight"]
    start = t.offset + e * (t.n_bytes // t.shape[0])
    flip_byte(copy, start + 100)
    code, out, err = moekit(capsys, "run", "--eager", copy, *RUN, "--expert-memory", SMALL)
    lines = err.splitlines()
    assert code == 2 and out == "" and all(line.startswith("note: ") for line in lines[:-1]), err
    assert f"layer 0 expert {e}: checksum mismatch in " in lines[-1] and "oss.gguf.moekit-experts.json" in lines[-1]
    line = refused(capsys, "run", copy, *RUN)  # resident: found while loading
    assert f"layer 0 expert {e} (tensor blk.0.ffn_up_exps.weight): checksum mismatch in oss.gguf (bytes {start}.." in line
    assert f"layer 0 expert {e}: checksum mismatch" in refused(capsys, "checksum", copy)
