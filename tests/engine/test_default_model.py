"""`moekit run "prompt"` with no checkpoint runs the bundled demo model (tests/train/test_demo_model.py
checks the model itself against transformers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from demo_figures import ACTIVE_SHARE, DEMO, E, K, LAYERS
from moekit.engine.default_model import bundled_model_path, split_checkpoint_and_prompt

MOEKIT = Path(sys.executable).parent / "moekit"
PROMPT = "def parse_args(argv):"


def test_the_bundled_model_is_models_moekit_demo_of_this_checkout():
    assert bundled_model_path() == DEMO == Path(__file__).resolve().parents[2] / "models" / "moekit-demo"
    assert (DEMO / "config.json").is_file() and (DEMO / "tokenizer.json").is_file()


def test_one_argument_is_a_prompt_unless_it_is_a_folder(tmp_path):
    assert split_checkpoint_and_prompt("hello", None) == (DEMO, "hello")
    assert split_checkpoint_and_prompt(str(tmp_path), None) == (tmp_path, None)
    assert split_checkpoint_and_prompt(str(tmp_path), "hi") == (tmp_path, "hi")
    assert split_checkpoint_and_prompt(None, None) == (DEMO, None)
    # with --prompt-ids the one argument can only be the checkpoint, even a missing one
    assert split_checkpoint_and_prompt("nope", None, ids_given=True) == (Path("nope"), None)


def test_run_with_no_checkpoint_uses_the_bundled_model():
    done = subprocess.run(
        [str(MOEKIT), "run", "--eager", PROMPT, "--max-new-tokens", "12", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert len(out["token_ids"]) >= 1
    assert isinstance(out["text"], str) and out["text"]
    # The demo model's figures, token by token: K = 2 of 128 experts in each of the 4 layers, and so
    # 1,815,968 of 19,427,744 parameters (9.35%, embedding counted in full) for every token.
    assert len(out["activation"]) == len(out["token_ids"])
    for a in out["activation"]:
        assert set(a["experts"]) == {str(l) for l in range(LAYERS)}
        assert all(len(set(ids)) == K and set(ids) <= set(range(E)) for ids in a["experts"].values())
        assert a["share"] == pytest.approx(ACTIVE_SHARE, rel=1e-12)
