"""`moekit calc` and `moekit simulate` plan what is true (issue 42, items 4-6): a model that does not
fit meets no latency budget and the line says what would make it fit; the KV cache is planned at the
model's own context, and a larger --context gets a word; a checkpoint is planned at the form it is
stored in, named; `--hardware local` names the dtype it measured."""

from __future__ import annotations

import json

import pytest

from cli_runner import moekit
from moekit.engine.default_model import bundled_model_path

DEMO = bundled_model_path()

DEEPSEEK_FP8_H100 = ("calc", "deepseek-v3", "--hardware", "h100", "--dtype", "fp8", "--sla-ms", "50")


def test_a_model_that_does_not_fit_meets_no_budget_and_the_table_says_what_would(capsys):
    code, out, _ = moekit(capsys, *DEEPSEEK_FP8_H100)
    assert code == 0
    text = " ".join(out.replace("│", " ").split())  # the cells' wrapped lines read as one
    assert "fits in memory NO" in text
    assert "meets (" not in text and "does NOT fit, needs --gpus 8 at fp8" in text
    assert "--expert-memory" in text and "paged from host" in text and "PCIe 5.0 x16, 64 GB/s nominal" in text


def test_calc_json_does_not_meet_a_budget_it_cannot_fit(capsys):
    sla = json.loads(moekit(capsys, *DEEPSEEK_FP8_H100, "--json")[1])["sla"]
    assert sla["fits_memory"] is False and sla["meets"] is False and sla["model_ms"] < sla["budget_ms"]
    assert sla["devices_needed"] == 8 and 0 < sla["paged_share"] < 1 and sla["paged_ms"] > 0


def test_explain_says_it_would_meet_only_if_it_fit(capsys):
    out = moekit(capsys, *DEEPSEEK_FP8_H100, "--explain")[1]
    assert "it would meet the budget if it fit in memory" in out and "it does NOT fit: needs --gpus 8 at fp8" in out


def test_at_enough_devices_the_same_model_meets(capsys):
    sla = json.loads(moekit(capsys, *DEEPSEEK_FP8_H100, "--gpus", "8", "--json")[1])["sla"]
    assert sla["fits_memory"] is True and sla["meets"] is True


def test_simulate_gives_no_time_to_a_plan_whose_experts_do_not_fit(capsys):
    args = ("simulate", "--uniform", "deepseek-v3", "--tokens", "64", "--forwards", "2", "--ranks", "2,64",
            "--hardware", "h100", "--dtype", "fp8")
    doc = json.loads(moekit(capsys, *args, "--json")[1])
    fits = {r["ranks"]: r["fits_memory"] for r in doc["results"]}
    assert fits == {2: False, 64: True}
    out = " ".join(moekit(capsys, *args)[1].replace("│", " ").split())
    assert "does not fit" in out and "exceed one device's 80.00 GiB" in out


def test_the_kv_cache_is_planned_at_the_models_own_context(capsys):
    code, out, err = moekit(capsys, "calc", DEMO, "--json")
    assert code == 0
    assert json.loads(out)["memory"]["context"] == 1024
    assert "planning a 1,024-token context, its max_position_embeddings" in err


def test_a_context_beyond_the_models_limit_gets_a_word(capsys):
    code, out, err = moekit(capsys, "calc", DEMO, "--context", "100000", "--json")
    assert code == 0 and json.loads(out)["memory"]["context"] == 100_000
    assert "--context 100,000 exceeds its max_position_embeddings (1,024)" in err


@pytest.mark.parametrize("stated, planned", [
    ({"torch_dtype": "float32"}, "fp32"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "fp8"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "mxfp4"),
])
def test_a_checkpoint_is_planned_at_the_form_it_is_stored_in(capsys, tmp_path, stated, planned):
    config = json.loads((DEMO / "config.json").read_text())
    config.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, **stated}))
    code, out, err = moekit(capsys, "calc", tmp_path, "--json")
    assert code == 0, err
    assert json.loads(out)["memory"]["dtype"] == planned
    assert f"planning at {planned}, as stored" in err


def test_local_hardware_names_the_dtype_it_measured(capsys):
    out = moekit(capsys, "calc", DEMO, "--hardware", "local", "--explain")[1]
    assert "peak fp32" in out and "peak bf16" not in out
    assert "bf16 weights compute at the fp32 rate" in out
