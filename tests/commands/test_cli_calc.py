"""`moekit calc` as a user runs it: the real console script in a subprocess."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

MOEKIT = Path(sys.executable).parent / "moekit"
SHARED_KEYS = {
    "model", "model_type", "total_params", "active_params", "active_params_excl_input_embedding",
    "active_params_non_embedding", "active_fraction", "breakdown", "memory",
}
MIXTRAL_CONFIG = {
    "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2,
}


def moekit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(MOEKIT), "calc", *args], capture_output=True, text=True, timeout=120)


def ok(*args: str) -> str:
    result = moekit(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def write_config(tmp_path: Path, config: dict, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def test_preset_table():
    out = ok("mixtral-8x7b")
    assert "mixtral-8x7b" in out and "46.70B" in out and "12.88B" in out


def test_config_json(tmp_path):
    data = json.loads(ok(write_config(tmp_path, MIXTRAL_CONFIG), "--json"))
    assert SHARED_KEYS <= set(data)
    assert data["total_params"] == 46_702_792_704  # the same model as the preset
    assert data["memory"]["weight_bytes"] == 2 * data["total_params"]
    assert "roofline" not in data and "sla" not in data


def test_checkpoint_folder(tmp_path):
    write_config(tmp_path, MIXTRAL_CONFIG)
    assert json.loads(ok(str(tmp_path), "--json"))["model"] == tmp_path.name


def test_hardware_dtype_context_batch():
    data = json.loads(ok("deepseek-v3", "--hardware", "h100", "--dtype", "fp8", "--context", "32768", "--batch", "8", "--json"))
    roof = data["roofline"]
    assert roof["hardware"] == "h100-sxm" and roof["peak_dtype"] == "fp8"
    assert roof["batch"]["batch"] == 8 and roof["batch"]["tokens_per_s"] > roof["batch1"]["tokens_per_s"]
    assert roof["fits"] is False  # 671B at fp8 is not one 80 GB device
    assert data["memory"]["mtp_bytes"] == data["breakdown"]["mtp"] > 0


def test_gpus_make_it_fit():
    data = json.loads(ok("deepseek-v3", "--hardware", "h200", "--dtype", "fp8", "--gpus", "8", "--json"))
    assert data["roofline"]["fits"] is True and data["roofline"]["gpus"] == 8


def test_sla():
    data = json.loads(ok("qwen3-30b-a3b", "--hardware", "a100-80gb", "--sla-ms", "50", "--json"))
    sla = data["sla"]
    assert sla["budget_ms"] == 50 and sla["max_params"] > 0
    assert sla["max_share"] == pytest.approx(sla["max_params"] / data["total_params"])
    out = ok("qwen3-30b-a3b", "--hardware", "a100-80gb", "--sla-ms", "50")
    assert "SLA budget" in out


def test_explain_rumour():
    out = ok("gpt4-rumored", "--explain")
    assert "not 2.00%" in out and "15." in out and "never confirmed" in out


def test_list():
    out = ok("--list")
    for name in ("mixtral-8x7b", "gpt4-rumored", "h100-sxm", "mi300x", "local"):
        assert name in out
    listed = json.loads(ok("--list", "--json"))
    assert "deepseek-v3" in listed["presets"]


def test_csv_side_by_side(tmp_path):
    a = write_config(tmp_path, MIXTRAL_CONFIG, "a.json")
    b = write_config(tmp_path, {**MIXTRAL_CONFIG, "num_local_experts": 16}, "b.json")
    rows = list(csv.DictReader(io.StringIO(ok(a, b, "--csv"))))
    assert [r["model"] for r in rows] == ["a", "b"]
    assert int(rows[1]["breakdown.routed_experts_total"]) == 2 * int(rows[0]["breakdown.routed_experts_total"])
    # Same K: doubling E adds only router columns (32 layers × D × 8) to what a token touches.
    assert int(rows[1]["active_params"]) == int(rows[0]["active_params"]) + 32 * 4096 * 8


def test_local_hardware_is_measured():
    data = json.loads(ok("olmoe-1b-7b", "--hardware", "local", "--json"))
    roof = data["roofline"]
    assert roof["hardware"] == "local" and roof["bandwidth_bytes_per_s"] > 0 and roof["peak_flops"] > 0


def test_help_documents_every_option():
    out = ok("--help")
    for option in ("--hardware", "--dtype", "--kv-dtype", "--context", "--batch", "--gpus", "--sla-ms", "--explain", "--json", "--csv", "--list"):
        assert option in out


BAD_CONFIGS = {
    "invalid_json": "{not json",
    "missing_field": json.dumps({k: v for k, v in MIXTRAL_CONFIG.items() if k != "hidden_size"}),
    "non_numeric": json.dumps({**MIXTRAL_CONFIG, "hidden_size": "big"}),
    "k_above_e": json.dumps({**MIXTRAL_CONFIG, "num_experts_per_tok": 9}),
    "negative": json.dumps({**MIXTRAL_CONFIG, "num_hidden_layers": -4}),
    "unknown_model_type": json.dumps({**MIXTRAL_CONFIG, "model_type": "gpt5_moe"}),
}


def assert_one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_is_one_line(tmp_path, case):
    path = tmp_path / "config.json"
    path.write_text(BAD_CONFIGS[case])
    line = assert_one_line_error(moekit(str(path)))
    if case == "unknown_model_type":
        assert "mixtral" in line and "deepseek_v3" in line  # names the supported ones


def test_binary_and_missing_files(tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert_one_line_error(moekit(str(binary)))
    assert_one_line_error(moekit(str(tmp_path / "nope.json")))


@pytest.mark.parametrize(
    "args",
    [
        ["--hardware", "tpu-v9"],
        ["--dtype", "int3"],
        ["--context", "lots"],
        ["--context", "-5"],
        ["--batch", "0"],
        ["--hardware", "h100", "--gpus", "2.5"],
        ["--hardware", "h100", "--sla-ms", "-1"],
        ["--hardware", "h100", "--sla-ms", "soon"],
        ["--sla-ms", "50"],
        ["--json", "--csv"],
    ],
    ids=lambda a: " ".join(a),
)
def test_nonsense_options_are_one_line(args):
    assert_one_line_error(moekit("mixtral-8x7b", *args))


def test_no_model_is_one_line():
    assert_one_line_error(moekit())


def test_calculator_never_imports_torch():
    code = (
        "import sys; sys.argv = ['moekit', 'calc', 'deepseek-v3', '--hardware', 'h100', '--sla-ms', '20', '--explain'];"
        "from moekit.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
