"""The bundled demo model: `moekit run "prompt"` with no checkpoint, and transformers agreeing with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moekit.engine.default_model import bundled_model_path, split_checkpoint_and_prompt

MOEKIT = Path(sys.executable).parent / "moekit"
PROMPT = "def parse_args(argv):"


def test_bundled_model_is_shipped():
    folder = bundled_model_path()
    assert (folder / "config.json").is_file()
    assert (folder / "tokenizer.json").is_file()
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size <= 40 * 2**20


def test_one_argument_is_a_prompt_unless_it_is_a_folder(tmp_path):
    assert split_checkpoint_and_prompt("hello", None) == (bundled_model_path(), "hello")
    assert split_checkpoint_and_prompt(str(tmp_path), None) == (tmp_path, None)
    assert split_checkpoint_and_prompt(str(tmp_path), "hi") == (tmp_path, "hi")
    assert split_checkpoint_and_prompt(None, None) == (bundled_model_path(), None)


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
    assert all(0 < s < 0.1 for s in shares)  # single-digit active share, as shipped


def test_transformers_greedy_equals_moekit_on_the_bundled_model():
    transformers = pytest.importorskip("transformers")
    import moekit

    folder = bundled_model_path()
    engine = moekit.load(folder, dtype="float32")
    ids = engine.encode(PROMPT)
    ours = engine.generate(ids, max_new_tokens=24, stop_ids=()).token_ids[0]

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = model.generate(
            torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )[0, len(ids):].tolist()
    assert ours == theirs
