"""`moekit cache-sim` on a trace the real engine wrote: its counts add up, a cache holding every
expert misses only on first uses, Belady bounds the live policies, and bad input is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from hf_tiny import write_checkpoint
from moekit import cli
from moekit.engine.loader import load_engine
from moekit.engine.trace import trace_model, write_trace
from moekit.errors import MoekitError
from moekit.analysis.cache_sim import trace_calls
from moekit.offload.policies import make_policy
from moekit.offload.slot_cache import SlotCache, most_pins

PROMPTS = [[5, 17, 42, 9, 77, 3, 101], [8, 64, 12]]
NEW = 16
NUM_EXPERTS = 8  # hf_tiny's qwen3_moe


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """(trace path, generated ids) of a real two-row greedy run."""
    folder = write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))
    engine = load_engine(folder, compile=False)
    gen = engine.generate(PROMPTS, max_new_tokens=NEW, stop_ids=())
    path = tmp_path_factory.mktemp("trace") / "trace.parquet"
    write_trace(gen, path, trace_model(engine.spec, folder))
    return path, gen.token_ids


def _forwards(path) -> dict[int, list[set[int]]]:
    """The slow, obvious grouping: layer -> per step (in order), the distinct experts."""
    by = defaultdict(set)
    for r in pq.read_table(path).to_pylist():
        by[(r["step"], r["layer"])].update(r["expert_ids"])
    out = defaultdict(list)
    for (step, layer) in sorted(by):
        out[layer].append(by[(step, layer)])
    return out


def _sim(*args) -> dict:
    cli._register()
    result = CliRunner().invoke(cli.app, ["cache-sim", *map(str, args), "--json"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _error(*args) -> str:
    cli._register()
    result = CliRunner().invoke(cli.app, ["cache-sim", *map(str, args)])
    assert isinstance(result.exception, MoekitError), result.output
    message = str(result.exception)
    assert "\n" not in message
    return message


def test_counts_add_up_and_a_full_cache_misses_only_first_uses(traced):
    path, generated = traced
    forwards = _forwards(path)
    accesses = sum(len(f) for calls in forwards.values() for f in calls)
    first_uses = sum(len(set().union(*calls)) for calls in forwards.values())

    report = _sim(path, "--policy", "lru,lfu,lfu-aging,belady", "--slots", f"2,4,{NUM_EXPERTS}")
    assert report["num_experts"] == NUM_EXPERTS
    assert report["accesses"] == accesses
    assert report["generated_tokens"] == sum(len(t) for t in generated) == len(PROMPTS) * NEW
    assert len(report["results"]) == 12
    for r in report["results"]:
        assert r["hits"] + r["misses"] == r["accesses"] == accesses
        assert sum(layer["accesses"] for layer in r["layers"].values()) == accesses
        assert sum(layer["misses"] for layer in r["layers"].values()) == r["misses"]
        assert r["prefill_misses"] + r["decode_misses"] == r["misses"]
        assert r["decode_misses_per_token"] == pytest.approx(r["decode_misses"] / report["decode_tokens"])
        if r["slots"] == NUM_EXPERTS:
            assert (r["misses"], r["evictions"]) == (first_uses, 0)
            assert r["slots_share"] == 1.0
    for slots in (2, 4):
        hits = {r["policy"]: r["hits"] for r in report["results"] if r["slots"] == slots}
        assert all(hits["belady"] >= h for h in hits.values()), hits
        assert hits["lru"] < hits["belady"] or slots == NUM_EXPERTS  # the small cache leaves room


@pytest.mark.parametrize("policy", ["lru", "lfu-aging"])
def test_the_simulation_is_a_plain_replay_of_every_layer(traced, policy):
    path, _ = traced
    want = {}
    for layer, calls in _forwards(path).items():
        cache = SlotCache(3, make_policy(policy))
        for needed in calls:
            cache.call(needed)
        want[str(layer)] = (cache.hits, cache.misses, cache.evictions)
    (r,) = _sim(path, "--policy", policy, "--slots", "3")["results"]
    assert {l: (v["hits"], v["misses"], v["evictions"]) for l, v in r["layers"].items()} == want


def test_slots_as_shares_of_the_experts(traced):
    path, _ = traced
    report = _sim(path, "--policy", "lru", "--slots", "25%,50%")
    assert [(r["slots"], r["slots_share"]) for r in report["results"]] == [(2, 0.25), (4, 0.5)]
    assert "has 8 experts per layer" in _error(path, "--policy", "lru", "--slots", "25%", "--num-experts", 16)


def test_pins_are_capped_like_a_live_run_and_always_hit(traced, tmp_path):
    path, _ = traced
    forwards = _forwards(path)
    layer = min(forwards)
    used = sorted(set().union(*forwards[layer]))
    pin = tmp_path / "profile.json"
    pin.write_text(json.dumps({"model": {}, "pins": {str(layer): used[:3]}}))

    report = _sim(path, "--policy", "lru", "--slots", f"4,{NUM_EXPERTS}", "--pin", pin)
    small, full = report["results"]
    assert small["pinned"] == most_pins(4) == 2
    assert any("capped at 2" in note for note in report["notes"])
    assert full["pinned"] == 3
    # Pins are loaded before the run: their first uses are hits.
    first_uses = sum(len(set().union(*calls)) for calls in forwards.values())
    assert full["misses"] == first_uses - 3


def test_tables_by_default(traced):
    path, _ = traced
    cli._register()
    result = CliRunner().invoke(cli.app, ["cache-sim", str(path), "--policy", "lru,belady", "--slots", "2"])
    assert result.exit_code == 0, result.output
    assert "belady" in result.output and "hit rate per layer" in result.output


def test_bad_input_is_one_line(traced, tmp_path):
    path, _ = traced
    assert "no such trace" in _error(tmp_path / "missing.parquet")
    text = tmp_path / "notes.parquet"
    text.write_text("not parquet")
    assert "not a Parquet trace" in _error(text)
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"step": [0], "token_id": [3]}), other)
    assert "missing column(s) row, layer, expert_ids" in _error(other)
    assert "at least 1 slot" in _error(path, "--slots", "0")
    assert "at least 1 slot" in _error(path, "--slots", "5%")  # 5% of 8 experts is 0 slots
    assert "expected whole numbers" in _error(path, "--slots", "four")
    assert "unknown policy 'fifo'" in _error(path, "--policy", "lru,fifo")
    assert "--num-experts 4" in _error(path, "--num-experts", 4)
    bad_pins = tmp_path / "pins.json"
    bad_pins.write_text(json.dumps({"pins": {"1": [99]}}))
    assert "pins expert 99" in _error(path, "--pin", bad_pins)
    bad_pins.write_text("[1, 2]")
    assert '"pins"' in _error(path, "--pin", bad_pins)


def test_trace_grouping_on_a_hand_built_trace():
    # Row 0 runs two decode steps, row 1 stops after one; layer 3 sees two prompt tokens of row 0.
    rows = [
        (0, 0, 3, [1, 2]), (0, 0, 3, [2, 5]), (0, 1, 3, [7, 1]), (0, 0, 5, [0, 1]),
        (1, 0, 3, [5, 6]), (1, 1, 3, [6, 4]), (1, 0, 5, [1, 0]),
        (2, 0, 3, [2, 1]), (2, 0, 5, [3, 1]),
    ]
    table = pa.table({
        "step": pa.array([r[0] for r in rows], pa.int32()),
        "row": pa.array([r[1] for r in rows], pa.int32()),
        "layer": pa.array([r[2] for r in rows], pa.int32()),
        "expert_ids": pa.array([r[3] for r in rows], pa.list_(pa.int32())),
    })
    calls = trace_calls(table)
    assert calls.layers == (3, 5)
    assert calls.calls == {3: [(1, 2, 5, 7), (4, 5, 6), (1, 2)], 5: [(0, 1), (0, 1), (1, 3)]}
    assert calls.prefill == {3: True, 5: True}
    assert (calls.max_expert, calls.decode_tokens, calls.generated_tokens) == (7, 3, 5)


_NO_TORCH = """
import sys
from moekit.analysis import cache_sim
from moekit.offload import budget, policies, slot_cache
from moekit.commands import cache_sim as command
calls = cache_sim.read_trace(sys.argv[1])
cache_sim.simulate(calls, "lfu-aging", 2)
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_cache_sim_runs_without_torch(traced):
    path, _ = traced
    out = subprocess.run([sys.executable, "-c", _NO_TORCH, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_command_line_exits_2_with_one_line(tmp_path):
    missing = tmp_path / "missing.parquet"
    out = subprocess.run([sys.executable, "-m", "moekit.cli", "cache-sim", str(missing)], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and str(missing) in out.stderr
