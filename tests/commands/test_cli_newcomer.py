"""What a new user meets first (issue 15): numbers that read right, and mistakes that are named.
Each test runs the CLI in-process, as a user types it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cli_runner import moekit

DEMO = Path(__file__).resolve().parents[2] / "models" / "moekit-demo"


def _flat(text: str) -> str:
    """Table text with rich's borders and wrapping removed: cells read as one line of words."""
    return " ".join(re.sub(r"[│┃┏┓┗┛┡┩└┘━─┳┻╇╈┼╋┣┫]", " ", text).split())


# -- calc ---------------------------------------------------------------------------------------


def test_calc_sla_a_whole_model_fits_says_so_not_166_percent(capsys):
    code, out, _ = moekit(capsys, "calc", "qwen3-30b-a3b", "--hardware", "a100-80gb", "--sla-ms", "50")
    flat = _flat(out)
    assert code == 0 and "166.30%" not in flat
    assert "all 30.53B: whole model fits" in flat and "headroom" in flat
    assert re.search(r"max batch in budget \d[\d,]* \((memory|budget) binds\)", flat)


def test_calc_sla_json_states_the_whole_model_fits(capsys):
    code, out, _ = moekit(capsys, "calc", "qwen3-30b-a3b", "--hardware", "a100-80gb", "--sla-ms", "50", "--json")
    sla = json.loads(out)["sla"]
    assert code == 0 and sla["whole_model_fits"] is True and sla["max_batch"] >= 1
    assert sla["headroom"] > 1


def test_calc_sla_explain_of_the_demo_model_answers_the_batch(capsys):
    code, out, _ = moekit(capsys, "calc", str(DEMO), "--hardware", "h100", "--sla-ms", "50", "--explain")
    assert code == 0 and "the whole model (19.43M) fits the budget" in out
    assert "largest batch decoded within 50 ms per step" in out


def test_calc_a_small_model_is_not_zero_gib(capsys):
    code, out, _ = moekit(capsys, "calc", str(DEMO), "mixtral-8x7b")
    flat = _flat(out)
    assert code == 0 and "0.00 GiB" not in flat
    assert "37.06 MiB @ bf16" in flat and "86.99 GiB @ bf16" in flat  # each in its own unit


# -- pack -------------------------------------------------------------------------------------


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    import hashlib

    return {p.name: (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in sorted(folder.iterdir())}


def test_pack_of_the_bundled_model_leaves_it_as_shipped_and_says_where(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    before = _snapshot(DEMO)
    code, out, err = moekit(capsys, "pack", DEMO)
    assert code == 0, err
    assert _snapshot(DEMO) == before  # no file rewritten, none added
    packed = next((tmp_path / "cache" / "moekit" / "packed").iterdir())
    assert f"packed checkpoint: {packed}" in out and f"moekit run {packed}" in out
    assert (packed / "experts.packed.safetensors").is_file()
    code, out, err = moekit(capsys, "run", "--eager", packed, "def f(x):", "--max-new-tokens", "3", "--expert-memory", "25%",
                            "--json")
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 3
