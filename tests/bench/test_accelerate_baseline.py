"""The accelerate disk-offload baseline and the offload benchmark checkpoint.

The baseline runs in a child process, as `moekit bench offload --vs accelerate` runs it; each
child imports transformers (a few seconds), so the runs here are few and the models tiny.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hf_tiny import write_checkpoint
from moekit.engine.loader import load_engine
from moekit.errors import MoekitError
from moekit.bench.accelerate_baseline import measure_accelerate

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

PROMPT = [1, 17, 42, 99, 5, 63, 120]
NEW = 8
REPO = Path(__file__).resolve().parents[2]


def _weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _bench_script():
    path = REPO / "benchmarks" / "make_offload_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_offload_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen_accelerate"), seed=3)


def test_a_cap_below_the_model_puts_weights_on_disk_and_generates_what_moekit_generates(qwen):
    cap = _weight_bytes(qwen) // 2
    run = measure_accelerate(qwen, cap, PROMPT, NEW, threads=1, dtype="float32")
    # moekit with no stop tokens: the baseline disables eos, so both decode exactly NEW tokens.
    ours = load_engine(qwen, compile=False).generate(PROMPT, max_new_tokens=NEW, stop_ids=()).token_ids[0]
    assert run["offloaded_bytes"] > 0
    assert run["device_map_summary"].get("disk", 0) > 0
    assert run["resident_param_bytes"] <= cap
    assert run["new_tokens"] == NEW
    assert run["token_ids"] == ours
    assert run["tokens_per_s"] > 0 and run["peak_rss_bytes"] >= run["peak_rss_before_load_bytes"] > 0


def test_a_cap_above_the_model_keeps_everything_in_memory(qwen):
    run = measure_accelerate(qwen, 4 * _weight_bytes(qwen), PROMPT, 2, threads=1, dtype="float32")
    assert run["offloaded_bytes"] == 0
    assert "disk" not in run["device_map_summary"]
    assert run["resident_param_bytes"] > 0


def test_a_child_that_fails_is_one_error_naming_the_cause(tmp_path):
    # A config without weights: transformers fails in the child; its last stderr line reaches the user.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}))
    with pytest.raises(MoekitError, match="accelerate baseline failed: .*(safetensors|weights|file)") as err:
        measure_accelerate(tmp_path, 10**6, PROMPT, 2, threads=1)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(memory_bytes=0), "memory"),
        (dict(prompt_ids=[]), "prompt"),
        (dict(new_tokens=0), "new tokens"),
        (dict(dtype="float16"), "dtype"),
    ],
)
def test_bad_requests_are_refused_before_a_child_starts(qwen, kwargs, message):
    args = dict(memory_bytes=10**6, prompt_ids=PROMPT, new_tokens=2, dtype="float32") | kwargs
    with pytest.raises(MoekitError, match=message):
        measure_accelerate(qwen, **args)


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(MoekitError, match="config.json"):
        measure_accelerate(tmp_path, 10**6, PROMPT, 2)


def test_the_2g_checkpoint_is_about_2_gb_of_mostly_routed_experts():
    bench = _bench_script()
    config = bench.hub_config("2g")
    plan = bench.tensor_plan(config)
    counts = bench.check_with_calculator(config, plan)  # moekit's calculator counts what would be written
    total = bench.plan_bytes(plan)
    assert 1.9e9 <= total <= 2.4e9
    assert bench.routed_expert_bytes(plan) >= 0.9 * total
    assert counts["total_params"] * 2 == total
    parts = bench.shards(plan, bench.MAX_SHARD_BYTES)
    assert len(parts) >= 4 and all(bench.plan_bytes(part) <= bench.MAX_SHARD_BYTES for part in parts)
    assert [t for part in parts for t in part] == plan


def test_the_small_offload_checkpoint_loads_in_moekit_and_transformers_alike(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    bench = _bench_script()
    folder = tmp_path / "offload-small"
    # Shards of 40 MB: the small variant is also written as a multi-shard Hub checkpoint.
    summary = bench.write_checkpoint(folder, "small", max_shard_bytes=40 * 1000 * 1000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert summary["shards"] >= 3
    assert sorted(set(index["weight_map"].values())) == sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert index["metadata"]["total_size"] == summary["total_bytes"]

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    engine = load_engine(folder, compile=False)
    assert engine.spec.moe_layers == tuple(range(bench.SHAPES["small"]["num_hidden_layers"]))

    prompt = [1, 17, 42, 99, 5]
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        theirs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4, pad_token_id=0)
    ours = engine.generate(prompt, max_new_tokens=4, stop_ids=()).token_ids[0]
    assert ours == theirs[0, len(prompt) :].tolist()


def test_the_parent_side_imports_without_torch_or_transformers():
    import subprocess
    import sys

    code = (
        "import sys, moekit.bench.accelerate_baseline; "
        "print(sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
