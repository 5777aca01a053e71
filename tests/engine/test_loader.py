"""`moekit.load`: the Python API a user calls, and the settings it reads from the folder."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import moekit
from moekit.errors import MoekitError


def test_load_generates_from_ids_and_meters(tiny_checkpoints):
    engine = moekit.load(tiny_checkpoints("olmoe"), compile=False)
    gen = engine.generate([1, 17, 42], max_new_tokens=5, stop_ids=())
    assert len(gen.token_ids[0]) == 5
    assert len(engine.meter(gen)) == 5
    assert engine.tokenizer is None
    with pytest.raises(MoekitError, match="tokenizer"):
        engine.generate("hello")


def test_stop_ids_come_from_config_and_generation_config(tiny_checkpoints, tmp_path):
    folder = shutil.copytree(tiny_checkpoints("olmoe"), tmp_path / "ckpt")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert moekit.load(folder, compile=False).eos_ids == (2, 7)


def test_bad_settings_are_refused(tiny_checkpoints):
    with pytest.raises(MoekitError, match="dtype"):
        moekit.load(tiny_checkpoints("olmoe"), dtype="float64", compile=False)
    if not torch.cuda.is_available():
        with pytest.raises(MoekitError, match="cuda"):
            moekit.load(tiny_checkpoints("olmoe"), device="cuda", compile=False)
    with pytest.raises(MoekitError, match="device"):
        moekit.load(tiny_checkpoints("olmoe"), device="tpu", compile=False)
