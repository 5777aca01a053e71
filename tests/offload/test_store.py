"""The live expert store: any budget, policy, pin set and prefetch setting generates exactly what the
fully resident engine generates, on checkpoints written by transformers' save_pretrained."""

from __future__ import annotations

import json
import shutil

import pytest

from hf_tiny import write_checkpoint
from moekit.engine.loader import load_engine
from moekit.errors import ExpertIntegrityError, MoekitError
from moekit.offload.options import OffloadOptions
from offload_files import PROMPTS, greedy_runs

NEW = 20


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen"), seed=1)


def _ids(folder, offload=None, dtype="float32", prompts=PROMPTS, new=NEW):
    return greedy_runs(folder, offload, dtype, prompts, new)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("budget", ["25%", "50%", "75%"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "lfu-aging", "lfru", "none"])
def test_every_budget_and_policy_generates_what_the_resident_engine_does(qwen, budget, policy, prefetch):
    want = _ids(qwen)[:2]
    single, batch, stats = _ids(qwen, OffloadOptions(budget, policy=policy, prefetch=prefetch))
    assert (single, batch) == want
    assert stats["loads"] > 0 and stats["accesses"] > 0
    if policy == "none":
        assert stats["hit_rate"] == 0.0  # every use read again


@pytest.mark.parametrize("prefetch", [True, False])
def test_bfloat16_with_and_without_prefetch_is_exact(qwen, prefetch):
    want = _ids(qwen, dtype="bfloat16")[:2]
    got = _ids(qwen, OffloadOptions("25%", prefetch=prefetch), dtype="bfloat16")
    assert got[:2] == want
    if prefetch:
        assert got[2]["prefetch_recall"] is not None and 0 <= got[2]["prefetch_recall"] <= 1
    else:
        assert got[2]["prefetch_recall"] is None


@pytest.mark.parametrize("family", ["mixtral", "granitemoe", "gpt_oss", "deepseek_v3", "qwen2_moe"])
def test_other_layouts_are_exact_at_the_minimum_budget(family, tmp_path):
    folder = write_checkpoint(family, tmp_path / family, seed=2)
    spec_k = json.loads((folder / "config.json").read_text()).get("num_experts_per_tok", 2)
    experts = json.loads((folder / "config.json").read_text())
    n = experts.get("num_local_experts") or experts.get("num_experts") or experts.get("n_routed_experts")
    budget = f"{100 * spec_k / n + 0.01:.2f}%"  # K experts per layer: the smallest budget allowed
    assert _ids(folder, OffloadOptions(budget))[:2] == _ids(folder)[:2]


def _pin_profile(folder, tmp_path):
    """(profile document, its file): the top 2 experts per layer over PROMPTS, as `moekit profile`
    writes it (the tiny checkpoint has no tokenizer: counted from token-id prompts)."""
    from moekit.offload.pins import model_identity, profile_document
    from moekit.analysis.profile import count_experts

    engine = load_engine(folder, compile=False)
    counts, _ = count_experts(engine, PROMPTS, max_new_tokens=8)
    doc = profile_document(model_identity(folder, engine.spec), counts, top=2, workload={})
    engine.close()
    pin = tmp_path / "profile.json"
    pin.write_text(json.dumps(doc))
    return doc, pin


def test_pins_from_a_profile_stay_resident_and_change_nothing(qwen, tmp_path):
    doc, pin = _pin_profile(qwen, tmp_path)
    engine = load_engine(qwen, offload=OffloadOptions("50%", pin=pin), compile=False)
    try:
        for layer, store in engine.store.layers.items():
            assert store.cache.pinned == set(doc["pins"][str(layer)])
        got = engine.generate(PROMPTS, max_new_tokens=NEW, stop_ids=()).token_ids
        for layer, store in engine.store.layers.items():
            assert set(doc["pins"][str(layer)]) <= store.cache.resident  # never evicted
    finally:
        engine.close()
    assert got == _ids(qwen)[1]


def test_a_pin_file_for_another_model_is_refused(qwen, tmp_path):
    other = write_checkpoint("qwen3_moe", tmp_path / "other", seed=1, num_experts=16)
    from moekit.offload.pins import model_identity, profile_document
    from moekit.spec import load_spec

    doc = profile_document(model_identity(other, load_spec(other)), {0: [1] * 16, 1: [1] * 16}, top=2, workload={})
    pin = tmp_path / "p.json"
    pin.write_text(json.dumps(doc))
    with pytest.raises(MoekitError, match="made for another model"):
        load_engine(qwen, offload=OffloadOptions("50%", pin=pin), compile=False)


def test_budgets_below_the_minimum_or_above_everything(qwen):
    with pytest.raises(MoekitError, match="below the minimum"):
        load_engine(qwen, offload=OffloadOptions("1%"), compile=False)
    engine = load_engine(qwen, offload=OffloadOptions("100GiB"), compile=False)
    assert engine.store is None and any("fully resident" in n for n in engine.notes)


def test_live_hits_equal_the_cache_simulation_of_the_same_trace(qwen, tmp_path):
    """Without prefetch, the store makes exactly the SlotCache.call sequence cache-sim replays."""
    from moekit.engine.trace import write_trace
    from moekit.analysis.cache_sim import read_trace, simulate

    engine = load_engine(qwen, offload=OffloadOptions("50%", policy="lfu", prefetch=False), compile=False)
    try:
        gen = engine.generate(PROMPTS[0], max_new_tokens=NEW, stop_ids=())
        live = engine.store.stats()
    finally:
        engine.close()
    write_trace(gen, tmp_path / "t.parquet")
    sim = simulate(read_trace(tmp_path / "t.parquet"), "lfu", live["slots_per_layer"])
    for layer, result in sim.layers.items():
        ours = live["layers"][str(layer)]
        assert (result.hits, result.hits + result.misses) == (ours["hits"], ours["accesses"])


def test_a_corrupted_expert_fails_the_request_names_it_and_never_serves_wrong_weights(qwen, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(qwen, folder)
    want = _ids(folder)[1]
    _ids(folder, OffloadOptions("25%"))  # first run writes the checksum manifest
    manifest = json.loads((folder / "moekit-experts.json").read_text())
    from moekit.weights.manifest import from_json

    m = from_json(manifest)
    (layer, expert), ex = next(iter(sorted(m.experts.items())))
    extent = ex.extents[0]
    path = folder / extent.file
    original = path.read_bytes()
    spoiled = bytearray(original)
    spoiled[extent.offset + 3] ^= 0x40
    path.write_bytes(bytes(spoiled))

    engine = load_engine(folder, offload=OffloadOptions("25%", policy="none", prefetch=False), compile=False)
    try:
        with pytest.raises(ExpertIntegrityError, match=rf"layer {layer} expert {expert}\b.*{extent.file}|{extent.file}.*layer {layer} expert {expert}\b"):
            for prompt in ([e] for e in range(150)):  # some prompt routes to the spoiled expert
                engine.generate(prompt, max_new_tokens=4, stop_ids=())
        # The process goes on: the same engine serves the next request once the file is whole again.
        path.write_bytes(original)
        assert engine.generate(PROMPTS, max_new_tokens=NEW, stop_ids=()).token_ids == want
    finally:
        engine.close()


def test_a_decode_miss_writes_into_an_evicted_experts_tensors(qwen):
    """Once the slots are full, a miss reads into the weights of the expert it evicts: no allocation
    in the decode loop. Each LayerStore's load is observed (the real loader still runs)."""
    engine = load_engine(qwen, offload=OffloadOptions("50%", prefetch=False), compile=False)
    seen: list[tuple[int, bool, bool]] = []  # (forward, given a spare, filled that spare in place)
    try:
        for store in engine.store.layers.values():
            def observed(layer, e, into, load=store._load, store=store):
                got = load(layer, e, into)
                filled = into is not None and all(a.data_ptr() == b.data_ptr() for a, b in zip(got, into))
                seen.append((store.stats.forwards, into is not None, filled))
                return got

            store._load = observed
        got = engine.generate(PROMPTS[0], max_new_tokens=NEW, stop_ids=()).token_ids
    finally:
        engine.close()
    assert got == _ids(qwen)[0][:1]
    decode = [(spare, filled) for forward, spare, filled in seen if forward > 0]
    assert decode, "no decode step missed: the test shows nothing"
    assert all(spare and filled for spare, filled in decode), decode


def test_experts_fetched_for_a_token_are_never_overwritten_before_they_run(tmp_path):
    """At the minimum budget with pins, a token's later misses must evict experts it fetched but has
    not run yet; their tensors are not handed to the next load while the forward is under way."""
    folder = write_checkpoint("qwen3_moe", tmp_path / "wide", seed=3, num_experts=16, num_experts_per_tok=4)
    _, pin = _pin_profile(folder, tmp_path)
    engine = load_engine(folder, offload=OffloadOptions(f"{100 * 4 / 16 + 0.01:.2f}%", pin=pin, prefetch=False), compile=False)
    try:
        single = [engine.generate(p, max_new_tokens=NEW, stop_ids=()).token_ids[0] for p in PROMPTS]
        stats = engine.store.stats()
        for store in engine.store.layers.values():
            # Every slot is held again once the forwards are over, by an expert or as a spare.
            held = [w[0].data_ptr() for w in store._spare] + [f.result()[0].data_ptr() for f in store._weights.values()]
            assert store._slot_ptrs <= set(held)
            assert len(held) <= store._slot_count + 4  # K beyond the slots at most, until evicted
    finally:
        engine.close()
    assert stats["slots_per_layer"] == 4 and stats["pinned"] > 0
    assert single == _ids(folder)[0]


@pytest.mark.parametrize("budget", ["25%", "60%"])
@pytest.mark.parametrize("read_ahead", [1, 3])
def test_parallel_reads_give_the_serial_reads_tokens_and_hits(qwen, budget, read_ahead):
    # read_ahead 0 is the plain reference: each miss read inline, one after another.
    serial = _ids(qwen, OffloadOptions(budget, read_ahead=0))
    parallel = _ids(qwen, OffloadOptions(budget, read_ahead=read_ahead))
    assert parallel[:2] == serial[:2] == _ids(qwen)[:2]
    for name in ("accesses", "hit_rate", "decode_hit_rate", "loads", "disk_bytes"):
        assert parallel[2][name] == serial[2][name], name


def _singles_and_slots(folder, options):
    """Each prompt alone through one paged engine: (token ids, store stats, whether every slot is
    held again, by an expert or as a spare, and no more memory than the slots)."""
    engine = load_engine(folder, offload=options, compile=False)
    try:
        single = [engine.generate(p, max_new_tokens=NEW, stop_ids=()).token_ids[0] for p in PROMPTS]
        slots_back = True
        for store in engine.store.layers.values():
            held = [w[0].data_ptr() for w in store._spare] + [f.result()[0].data_ptr() for f in store._weights.values()]
            slots_back &= bool(store._slot_ptrs) and store._slot_ptrs <= set(held) and len(held) <= store._slot_count
        return single, engine.store.stats(), slots_back
    finally:
        engine.close()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_prompt_read_ahead_wider_than_the_slots_runs_evicted_experts_on_their_own_weights(qwen, policy):
    """At the minimum budget (2 slots) a 7-token prompt needs up to 8 experts and a read-ahead of 3
    walks 4 at a time, so the walk evicts experts it has read but not run yet: they run on what was
    read for them, and the memory goes back to the slots when the forward ends."""
    tokens, stats, slots_back = _singles_and_slots(qwen, OffloadOptions("25%", policy=policy, read_ahead=3))
    serial, serial_stats, _ = _singles_and_slots(qwen, OffloadOptions("25%", policy=policy, read_ahead=0))
    assert stats["slots_per_layer"] == 2 and slots_back
    assert tokens == serial == _ids(qwen)[0]
    for name in ("accesses", "hit_rate", "loads", "disk_bytes"):
        assert stats[name] == serial_stats[name], name


def _trace(folder, tmp_path, prompts=PROMPTS) -> "Path":
    """A routing trace of greedy runs of `prompts`, as `moekit run --trace` writes it."""
    from moekit.engine.trace import trace_model, write_trace

    engine = load_engine(folder, compile=False)
    path = tmp_path / "t.parquet"
    try:
        gen = engine.generate(prompts, max_new_tokens=12, stop_ids=())
        write_trace(gen, path, trace_model(engine.spec, folder))
    finally:
        engine.close()
    return path


@pytest.mark.parametrize("budget", ["25%", "75%"])  # 2 slots a layer (the minimum: equal) and 6 (split 7 + 5)
def test_a_budget_split_by_a_trace_gives_each_layer_its_measured_share_and_the_resident_tokens(qwen, tmp_path, budget):
    from moekit.offload.budget import split_slots
    from moekit.offload.trace_split import hit_curves

    trace = _trace(qwen, tmp_path)
    single, batch, stats = _ids(qwen, OffloadOptions(budget, split=trace))
    assert (single, batch) == _ids(qwen)[:2]
    curves = hit_curves(trace, [0, 1], 8, "lru")
    assert all(c[0] == 0 and c == sorted(c) for c in curves.values()) and curves[0][8] > 0
    want = split_slots(curves, stats["slots_per_layer"], low=2)
    assert stats["slots_by_layer"] == {str(l): n for l, n in want.items()}
    assert sum(want.values()) == stats["slots_per_layer"] * 2
    if budget == "75%":
        assert len(set(want.values())) == 2  # uneven: the slot memory is carved per layer


def test_a_split_trace_from_another_model_is_refused(qwen, tmp_path):
    other = write_checkpoint("qwen3_moe", tmp_path / "other", seed=1, num_experts=16, num_hidden_layers=3)
    trace = _trace(other, tmp_path)
    with pytest.raises(MoekitError, match="not this model's"):
        load_engine(qwen, offload=OffloadOptions("50%", split=trace), compile=False)


def test_direct_io_reads_give_the_resident_tokens_and_the_same_hits(qwen):
    plain = _ids(qwen, OffloadOptions("25%"))
    direct = _ids(qwen, OffloadOptions("25%", direct_io=True))
    assert direct[:2] == plain[:2] == _ids(qwen)[:2]
    for name in ("accesses", "hit_rate", "loads", "disk_bytes"):
        assert direct[2][name] == plain[2][name], name
