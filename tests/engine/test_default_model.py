"""`moekit run "prompt"` with no checkpoint runs the bundled demo model (tests/train/test_demo_model.py
checks the model itself against transformers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from moekit.engine.default_model import bundled_model_path, split_checkpoint_and_prompt

MOEKIT = Path(sys.executable).parent / "moekit"
PROMPT = "def parse_args(argv):"


def test_one_argument_is_a_prompt_unless_it_is_a_folder(tmp_path):
    assert split_checkpoint_and_prompt("hello", None) == (bundled_model_path(), "hello")
    assert split_checkpoint_and_prompt(str(tmp_path), None) == (tmp_path, None)
    assert split_checkpoint_and_prompt(str(tmp_path), "hi") == (tmp_path, "hi")
    assert split_checkpoint_and_prompt(None, None) == (bundled_model_path(), None)
    # with --prompt-ids the one argument can only be the checkpoint, even a missing one
    assert split_checkpoint_and_prompt("nope", None, ids_given=True) == (Path("nope"), None)


def test_run_with_no_checkpoint_uses_the_bundled_model():
    done = subprocess.run(
        [str(MOEKIT), "run", PROMPT, "--max-new-tokens", "12", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert len(out["token_ids"]) >= 1
    assert isinstance(out["text"], str) and out["text"]
    shares = [a["share"] for a in out["activation"]]
    # a sparse model: every token touches a fraction of the parameters (embedding counted in full)
    assert all(0 < s < 0.5 for s in shares)
